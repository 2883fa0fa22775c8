# ctest readme_quickstart: README.md's quick-start code block must be examples/quickstart.cpp verbatim.
# Usage: cmake -DREADME=<README.md> -DSOURCE=<examples/quickstart.cpp> -P check_readme_quickstart.cmake
# The block is the ```cpp fence right after the marker line below in README.md. To update the README
# after editing quickstart.cpp, paste the file between that fence's opening and closing lines.
set(marker "<!-- examples/quickstart.cpp verbatim (ctest readme_quickstart checks it) -->\n```cpp\n")
file(READ "${README}" readme)
file(READ "${SOURCE}" source)
string(FIND "${readme}" "${marker}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "${README}: no line '<!-- examples/quickstart.cpp verbatim (ctest readme_quickstart checks it) -->' followed by a ```cpp fence")
endif()
string(LENGTH "${marker}" marker_len)
math(EXPR begin "${at} + ${marker_len}")
string(SUBSTRING "${readme}" ${begin} -1 rest)
string(FIND "${rest}" "\n```\n" end)
if(end EQUAL -1)
  message(FATAL_ERROR "${README}: the quick-start ```cpp fence is not closed")
endif()
math(EXPR end "${end} + 1")  # keep the last line's newline
string(SUBSTRING "${rest}" 0 ${end} block)
if(NOT block STREQUAL source)
  file(WRITE "${CMAKE_CURRENT_BINARY_DIR}/readme_quickstart_block.cpp" "${block}")
  message(FATAL_ERROR "README.md's quick-start block differs from ${SOURCE}; the block as read is in "
                      "${CMAKE_CURRENT_BINARY_DIR}/readme_quickstart_block.cpp (diff it against the source)")
endif()
message(STATUS "README.md's quick-start block is ${SOURCE} verbatim")
