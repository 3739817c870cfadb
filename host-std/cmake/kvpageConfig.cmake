# find_package(kvpage) support for an installed kvpage: the imported target
# kvpage::kvpage (static library, header, native libraries).
get_filename_component(_kvpage_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET kvpage::kvpage)
  add_library(kvpage::kvpage STATIC IMPORTED)
  set_target_properties(kvpage::kvpage PROPERTIES
    IMPORTED_LOCATION "${_kvpage_prefix}/lib/libkvpage.a"
    INTERFACE_INCLUDE_DIRECTORIES "${_kvpage_prefix}/include"
    INTERFACE_LINK_LIBRARIES "gcc_s;util;rt;pthread;m;dl;c")
endif()
set(kvpage_FOUND TRUE)
unset(_kvpage_prefix)
