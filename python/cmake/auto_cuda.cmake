# Included by pip builds (CMAKE_PROJECT_INCLUDE, see pyproject.toml) right after project():
# decides the CUDA backend before the top-level option() sees it.
#   FLASHPORT_CUDA=0|1 (or OFF|ON) in the environment: force off / on (also on re-configure)
#   unset: on where a CUDA compiler (nvcc) is found
#   FLASHPORT_CUDA_ARCHS="90"      : CMAKE_CUDA_ARCHITECTURES
if(DEFINED ENV{FLASHPORT_CUDA} AND NOT "$ENV{FLASHPORT_CUDA}" STREQUAL "")
  if("$ENV{FLASHPORT_CUDA}")
    set(FLASHPORT_CUDA ON CACHE BOOL "Build the CUDA backend" FORCE)
  else()
    set(FLASHPORT_CUDA OFF CACHE BOOL "Build the CUDA backend" FORCE)
  endif()
elseif(NOT DEFINED FLASHPORT_CUDA)
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(FLASHPORT_CUDA ON CACHE BOOL "Build the CUDA backend")
  else()
    set(FLASHPORT_CUDA OFF CACHE BOOL "Build the CUDA backend")
  endif()
endif()
message(STATUS "flashport: CUDA backend ${FLASHPORT_CUDA} (environment FLASHPORT_CUDA='$ENV{FLASHPORT_CUDA}')")
if(DEFINED ENV{FLASHPORT_CUDA_ARCHS} AND NOT "$ENV{FLASHPORT_CUDA_ARCHS}" STREQUAL "")
  set(CMAKE_CUDA_ARCHITECTURES "$ENV{FLASHPORT_CUDA_ARCHS}" CACHE STRING "CUDA architectures" FORCE)
endif()
