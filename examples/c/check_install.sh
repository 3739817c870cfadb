#!/usr/bin/env bash
# Keeps the ways of linking kvpage from C true, on a tree where `cmake --build
# target/c-build` ran (it built target/release/libkvpage.a):
# 1. the native libraries rustc reports for the static library are the ones the README's
#    link line, host-std/CMakeLists.txt, kvpageConfig.cmake and kvpage.pc.in name;
# 2. the README's compile and link lines, run verbatim, build programs that work;
# 3. `cmake --install` gives a prefix that pkg-config and find_package(kvpage) consume.
set -euo pipefail
cd "$(dirname "$0")/../.."

fail() { echo "check_install: $*" >&2; exit 1; }

libs=$(cargo rustc -q --locked -p kvpage --lib --release --crate-type staticlib \
  -- --print native-static-libs 2>&1 | sed -n 's/.*native-static-libs: //p' | tail -n 1)
[ -n "$libs" ] || fail "rustc printed no native-static-libs"
echo "native-static-libs: $libs"
cmake_libs=$(echo "$libs" | sed 's/-l//g')
grep -qF "target/release/libkvpage.a $libs" README.md \
  || fail "README's link line does not end in 'target/release/libkvpage.a $libs'"
grep -qF "set(KVPAGE_NATIVE_LIBS $cmake_libs)" host-std/CMakeLists.txt \
  || fail "host-std/CMakeLists.txt's KVPAGE_NATIVE_LIBS is not '$cmake_libs'"
grep -qF "INTERFACE_LINK_LIBRARIES \"$(echo "$cmake_libs" | tr ' ' ';')\"" \
  host-std/cmake/kvpageConfig.cmake || fail "kvpageConfig.cmake's libraries differ"

# The README's lines between the link-line markers, verbatim.
sed -n '/<!-- link-line:begin -->/,/<!-- link-line:end -->/p' README.md \
  | sed -n '/^```sh$/,/^```$/p' | grep -v '^```' > target/readme-link-lines.sh
[ -s target/readme-link-lines.sh ] || fail "no link lines between the README's markers"
bash -euxo pipefail target/readme-link-lines.sh
./target/chat_c > target/chat_c.out && diff -u examples/c/expected/chat_c.txt target/chat_c.out
./target/chat_cpp > target/chat_cpp.out && diff -u examples/c/expected/chat_cpp.txt target/chat_cpp.out

prefix="$PWD/target/c-install"
rm -rf "$prefix"
cmake --install target/c-build --prefix "$prefix" > /dev/null
pc_libs=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --libs kvpage)
case "$pc_libs" in *"$libs"*) ;; *) fail "pkg-config --libs kvpage gives '$pc_libs'";; esac
# shellcheck disable=SC2046 # word splitting of pkg-config's flags is intended
cc -std=c99 -Wall -Wextra -Werror -pedantic examples/c/chat.c \
  $(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config --cflags --libs kvpage) -o target/chat_pc
./target/chat_pc | diff -u examples/c/expected/chat_c.txt -
cmake -S examples/c/find_package -B target/c-find-package -DCMAKE_PREFIX_PATH="$prefix" > /dev/null
cmake --build target/c-find-package > /dev/null
./target/c-find-package/chat_c | diff -u examples/c/expected/chat_c.txt -
echo "check_install: link line, pkg-config and find_package all work"
