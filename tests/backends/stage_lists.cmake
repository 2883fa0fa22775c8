# ctest stage_lists: every built-in stage implementation is in its backend's stage list.
#
#   cmake -DKVEVICT_INCLUDE_DIR=<repo>/include -P stage_lists.cmake
#
# A built-in policy's implementation on a backend is one file of its own under
# backends/<backend>/{scorers,spatial,budgeters,selectors}/, and the backend's umbrella header
# (kvevict/cpu.hpp, kvevict/cuda.cuh) reaches it through the stage lists (docs/architecture.md,
# "Why the stage lists"). This check follows the `#include "kvevict/..."` lines from each umbrella
# and fails, naming the file and the list to add it to, when a file in a stage folder is not
# reached: a built-in added without its one #include line would otherwise compile in its own test
# (which includes it directly) and fail only in a user's program, with the trait's "has no CPU
# implementation" message.
cmake_minimum_required(VERSION 3.21)
if(NOT KVEVICT_INCLUDE_DIR OR NOT IS_DIRECTORY "${KVEVICT_INCLUDE_DIR}/kvevict")
  message(FATAL_ERROR "stage_lists: KVEVICT_INCLUDE_DIR = '${KVEVICT_INCLUDE_DIR}' holds no kvevict/ folder")
endif()

# Every header under include/ reachable from `umbrella` (a path relative to include/) through
# quoted kvevict includes; result in `out` (paths relative to include/).
function(kvevict_reachable umbrella out)
  set(todo "${umbrella}")
  set(seen "")
  while(todo)
    list(POP_FRONT todo cur)
    if(cur IN_LIST seen)
      continue()
    endif()
    list(APPEND seen "${cur}")
    file(STRINGS "${KVEVICT_INCLUDE_DIR}/${cur}" lines REGEX "^[ \t]*#[ \t]*include[ \t]*\"kvevict/[^\"]+\"")
    foreach(line IN LISTS lines)
      string(REGEX REPLACE "^[ \t]*#[ \t]*include[ \t]*\"(kvevict/[^\"]+)\".*$" "\\1" inc "${line}")
      if(NOT EXISTS "${KVEVICT_INCLUDE_DIR}/${inc}")
        message(FATAL_ERROR "stage_lists: ${cur} includes \"${inc}\", which does not exist")
      endif()
      list(APPEND todo "${inc}")
    endforeach()
  endwhile()
  set(${out} "${seen}" PARENT_SCOPE)
endfunction()

set(failures 0)
set(checked 0)
foreach(backend cpu cuda)
  if(backend STREQUAL "cpu")
    set(umbrella "kvevict/cpu.hpp")
    set(ext "hpp")
    set(lists "kvevict/cpu.hpp (budgeters, selectors), kvevict/backends/cpu/scorers.hpp, kvevict/backends/cpu/smoothers.hpp")
  else()
    set(umbrella "kvevict/cuda.cuh")
    set(ext "cuh")
    set(lists "kvevict/cuda.cuh")
  endif()
  kvevict_reachable("${umbrella}" reached)
  foreach(stage scorers spatial budgeters selectors)
    file(GLOB files RELATIVE "${KVEVICT_INCLUDE_DIR}" "${KVEVICT_INCLUDE_DIR}/kvevict/backends/${backend}/${stage}/*.${ext}")
    foreach(f IN LISTS files)
      math(EXPR checked "${checked} + 1")
      if(NOT f IN_LIST reached)
        message(SEND_ERROR "stage_lists: ${f} is not reached from ${umbrella}: add #include \"${f}\" to the ${backend} stage list (${lists})")
        math(EXPR failures "${failures} + 1")
      endif()
    endforeach()
  endforeach()
endforeach()
if(checked EQUAL 0)
  message(FATAL_ERROR "stage_lists: no stage implementation found under ${KVEVICT_INCLUDE_DIR}/kvevict/backends")
endif()
if(failures GREATER 0)
  message(FATAL_ERROR "stage_lists: ${failures} of ${checked} stage implementation files are in no stage list")
endif()
message(STATUS "stage_lists: all ${checked} stage implementation files are reached from kvevict/cpu.hpp or kvevict/cuda.cuh")
