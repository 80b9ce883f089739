# api.exports: libspyreccl.so exports exactly the functions that spyreccl.h declares.
#
# The linker version script (src/spyreccl.map) lists the exported symbols explicitly; this
# check catches a function added to the header but not to the map (callers would fail to
# link) and an internal symbol that leaked into the dynamic symbol table.
#
#   cmake -DHEADER=<spyreccl.h> -DLIBRARY=<libspyreccl.so> -DNM=<nm> -P test_api_exports.cmake
foreach(var HEADER LIBRARY NM)
  if(NOT ${var})
    message(FATAL_ERROR "api.exports: -D${var}=... is required")
  endif()
endforeach()

# Declared: every `SPYRECCL_API <type> spyrecclName(` of the header.
file(READ "${HEADER}" header)
string(REGEX MATCHALL "SPYRECCL_API[^;(]*[ *]spyreccl[A-Za-z0-9_]+\\(" declarations "${header}")
set(declared "")
foreach(declaration IN LISTS declarations)
  string(REGEX MATCH "spyreccl[A-Za-z0-9_]+\\($" name "${declaration}")
  string(REGEX REPLACE "\\($" "" name "${name}")
  list(APPEND declared "${name}")
endforeach()
list(SORT declared)
list(LENGTH declared declared_count)
if(declared_count LESS 20)
  message(FATAL_ERROR "api.exports: found only ${declared_count} declarations in ${HEADER}; "
                      "the pattern no longer matches the header's style")
endif()

# Exported: the defined dynamic symbols, without their version suffix; the version node
# itself (an absolute symbol named after it) is not a function.
execute_process(COMMAND "${NM}" -D --defined-only "${LIBRARY}"
  OUTPUT_VARIABLE nm_out RESULT_VARIABLE nm_rc ERROR_VARIABLE nm_err)
if(NOT nm_rc EQUAL 0)
  message(FATAL_ERROR "api.exports: ${NM} -D ${LIBRARY} failed (${nm_rc}): ${nm_err}")
endif()
string(REPLACE "\n" ";" nm_lines "${nm_out}")
set(exported "")
foreach(line IN LISTS nm_lines)
  if(line MATCHES "^[0-9a-fA-F]* *([A-Za-z]) ([^@ ]+)")
    if(NOT CMAKE_MATCH_1 STREQUAL "A")
      list(APPEND exported "${CMAKE_MATCH_2}")
    endif()
  endif()
endforeach()
list(SORT exported)

set(missing ${declared})
list(REMOVE_ITEM missing ${exported})
set(extra ${exported})
list(REMOVE_ITEM extra ${declared})
if(missing OR extra)
  message(FATAL_ERROR "api.exports: the exported symbols differ from the header.\n"
                      "  declared but not exported (add them to src/spyreccl.map): ${missing}\n"
                      "  exported but not declared (internal symbols leaking): ${extra}")
endif()
message(STATUS "api.exports: ${declared_count} functions declared and exported")
