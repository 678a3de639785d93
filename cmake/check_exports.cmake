# check_exports.cmake: checks that a shared libtidalloc exports exactly the
# functions marked TIDE_API: every one the public headers (INCLUDE/*.h:
# tidalloc.h, tidalloc_torch.h, tidalloc_testing.h) declare (a missing one is
# a function users cannot call) and those a source file marks TIDE_API for a
# plug-in interface; anything else exported is an internal that leaked.
#   cmake -DLIB=libtidalloc.so -DNM=nm -DINCLUDE=include -DSRC=src -P check_exports.cmake
foreach(var LIB NM INCLUDE SRC)
  if(NOT ${var})
    message(FATAL_ERROR "check_exports.cmake needs -D${var}=...")
  endif()
endforeach()

execute_process(COMMAND ${NM} -D --defined-only ${LIB}
                OUTPUT_VARIABLE nm_out RESULT_VARIABLE nm_rc)
if(NOT nm_rc EQUAL 0)
  message(FATAL_ERROR "${NM} -D ${LIB} failed (${nm_rc})")
endif()

# Functions and data ("T", "D", "B", "R", weak "W"/"V"), not the version node.
set(exported "")
string(REPLACE "\n" ";" nm_lines "${nm_out}")
foreach(line ${nm_lines})
  if(line MATCHES "^[0-9a-fA-F]* *[TDBRWVi] ([^@ ]+)")
    list(APPEND exported ${CMAKE_MATCH_1})
  endif()
endforeach()

file(GLOB headers ${INCLUDE}/*.h)
set(declared "")
foreach(header ${headers})
  file(READ ${header} text)
  string(REGEX MATCHALL "TIDE_API[^;(]*[ *](tide_[a-z0-9_]+)[ ]*\\(" decls "${text}")
  if(NOT decls)
    message(FATAL_ERROR "found no TIDE_API declaration in ${header}")
  endif()
  foreach(decl ${decls})
    string(REGEX MATCH "(tide_[a-z0-9_]+)[ ]*\\($" name "${decl}")
    list(APPEND declared ${CMAKE_MATCH_1})
  endforeach()
endforeach()
list(LENGTH declared n_declared)

# Functions a source file exports on purpose, for callers that look them up
# by name rather than through the header.
set(plugin "")
file(GLOB_RECURSE sources ${SRC}/*.c ${SRC}/*.h)
foreach(source ${sources})
  file(READ ${source} text)
  string(REGEX MATCHALL "TIDE_API[^;(]*[ *](tide_[a-z0-9_]+)[ ]*\\(" marked "${text}")
  foreach(decl ${marked})
    string(REGEX MATCH "(tide_[a-z0-9_]+)[ ]*\\($" name "${decl}")
    list(APPEND plugin ${CMAKE_MATCH_1})
  endforeach()
endforeach()

set(extra ${exported})
list(REMOVE_ITEM extra ${declared} ${plugin})
set(missing ${declared})
list(REMOVE_ITEM missing ${exported})

set(failed OFF)
if(extra)
  list(JOIN extra " " text)
  message(SEND_ERROR "exported but not declared in ${INCLUDE}/*.h: ${text}")
  set(failed ON)
endif()
if(missing)
  list(JOIN missing " " text)
  message(SEND_ERROR "declared in ${INCLUDE}/*.h but not exported (not defined yet?): ${text}")
  set(failed ON)
endif()
if(failed)
  message(FATAL_ERROR "the exports of ${LIB} do not match ${INCLUDE}/*.h")
endif()
list(LENGTH exported n_exported)
list(REMOVE_DUPLICATES plugin)
list(JOIN plugin " " text)
message(STATUS "${LIB}: ${n_exported} symbols exported: the ${n_declared} of ${INCLUDE}/*.h"
               " and those marked TIDE_API in ${SRC} (${text})")
