# Runs PROGRAM and fails unless it exits 0 with standard output equal to EXPECTED.
execute_process(COMMAND "${PROGRAM}"
  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${PROGRAM} exited with ${rc}\n--- stdout\n${out}\n--- stderr\n${err}")
endif()
file(READ "${EXPECTED}" want)
if(NOT out STREQUAL want)
  message(FATAL_ERROR "${PROGRAM}: output differs from ${EXPECTED}\n--- got\n${out}\n--- want\n${want}\n--- stderr\n${err}")
endif()
if(NOT err STREQUAL "")
  message(FATAL_ERROR "${PROGRAM} wrote to stderr (a sanitizer report?)\n${err}")
endif()
