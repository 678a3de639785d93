# expect_output.cmake: runs a program and passes only if it exits with 0 and
# its standard output matches a regular expression (ctest's own
# PASS_REGULAR_EXPRESSION would ignore the exit status).
#   cmake -DPROGRAM=path -DEXPECT=regex -P expect_output.cmake
execute_process(COMMAND ${PROGRAM} OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
message("${out}${err}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "${PROGRAM} exited with ${rc}")
endif()
if(NOT out MATCHES "${EXPECT}")
  message(FATAL_ERROR "the output of ${PROGRAM} does not match: ${EXPECT}")
endif()
