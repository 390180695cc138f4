# HIP build for AMD GPUs: compile-verified and ISA-checked, never run here (no AMD GPU is
# reachable). Included by src/gpu/CMakeLists.txt when FLASHPORT_HIP=ON.
#
# clang (>= 19, Debian's clang-19) compiles the HIP sources with Debian's HIP 5.2 headers and
# device libraries; scripts/hip_toolchain.sh installs them and makes the device-library folder
# (FLASHPORT_HIP_DEVICE_LIBS) that also holds the targets Debian lacks (gfx942, gfx1100, gfx1201).
# For every target in FLASHPORT_HIP_ARCHS this writes the device assembly of each source to
# <build>/hip_isa/<source>-<gfx>.s (what scripts/check_amd_isa.sh reads), and compiles the host
# pass once, so both halves of every kernel build.
#
# Not built yet: the HIP backend object (hip_backend(), host dispatch) and the CUDA main loop's
# HIP instance; FLASHPORT_WITH_HIP stays undefined, so dispatch has no HIP backend to offer.
set(FLASHPORT_HIP_ARCHS "gfx90a;gfx942;gfx1100;gfx1201" CACHE STRING "AMD targets (gfx names)")
set(FLASHPORT_HIP_DEVICE_LIBS "${PROJECT_SOURCE_DIR}/build-hip-toolchain/bitcode" CACHE PATH
    "Device-library folder with oclc_isa_version_<gfx>.bc for every target (scripts/hip_toolchain.sh)")
find_program(FLASHPORT_HIP_CLANG NAMES clang++ PATHS /usr/lib/llvm-19/bin NO_DEFAULT_PATH)
find_program(FLASHPORT_HIP_CLANG NAMES clang++-19)
if(NOT FLASHPORT_HIP_CLANG)
  message(FATAL_ERROR "flashport HIP: clang++-19 not found (run scripts/hip_toolchain.sh)")
endif()
if(NOT EXISTS /usr/include/hip/hip_runtime.h)
  message(FATAL_ERROR "flashport HIP: HIP headers not found (run scripts/hip_toolchain.sh)")
endif()
foreach(arch IN LISTS FLASHPORT_HIP_ARCHS)
  string(REGEX REPLACE "^gfx" "" _fp_isa "${arch}")
  if(NOT EXISTS "${FLASHPORT_HIP_DEVICE_LIBS}/oclc_isa_version_${_fp_isa}.bc")
    message(FATAL_ERROR "flashport HIP: ${FLASHPORT_HIP_DEVICE_LIBS}/oclc_isa_version_${_fp_isa}.bc "
                        "is missing (scripts/hip_toolchain.sh makes it)")
  endif()
endforeach()

# Kernel instances: the AMD attention tile, head dims 64/128 x fp16/bf16.
set(FLASHPORT_HIP_SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/attn_tile_amd.hip)
set(FLASHPORT_HIP_INSTANCES 4)
list(LENGTH FLASHPORT_HIP_ARCHS _fp_hip_narch)
message(STATUS "flashport HIP: ${FLASHPORT_HIP_INSTANCES} kernel instances x ${_fp_hip_narch} targets "
               "(${FLASHPORT_HIP_ARCHS}) with ${FLASHPORT_HIP_CLANG}; device code only, no HIP backend yet")

string(REPLACE ";" "," _fp_hip_archs "${FLASHPORT_HIP_ARCHS}")
set(_fp_hip_flags
  -x hip -std=c++20 -O3 -Wall -Wextra
  --rocm-path=/usr "--rocm-device-lib-path=${FLASHPORT_HIP_DEVICE_LIBS}"
  -I/usr/include -D__HIP_PLATFORM_AMD__ -include hip/hip_runtime.h
  -I${PROJECT_SOURCE_DIR}/include -I${PROJECT_SOURCE_DIR}/src -I${CMAKE_CURRENT_SOURCE_DIR}
  "-DFLASHPORT_GPU_ARCHS=\"${_fp_hip_archs}\"")
set(_fp_hip_offload)
foreach(arch IN LISTS FLASHPORT_HIP_ARCHS)
  list(APPEND _fp_hip_offload --offload-arch=${arch})
endforeach()

set(_fp_hip_outputs)
set(_fp_hip_dir ${CMAKE_BINARY_DIR}/hip_isa)
file(MAKE_DIRECTORY ${_fp_hip_dir})
file(GLOB _fp_hip_headers ${CMAKE_CURRENT_SOURCE_DIR}/*.hpp ${CMAKE_CURRENT_SOURCE_DIR}/*.cuh
                          ${PROJECT_SOURCE_DIR}/src/core/*.hpp)
foreach(src IN LISTS FLASHPORT_HIP_SOURCES)
  get_filename_component(_fp_stem ${src} NAME_WE)
  foreach(arch IN LISTS FLASHPORT_HIP_ARCHS)
    set(_fp_out ${_fp_hip_dir}/${_fp_stem}-${arch}.s)
    add_custom_command(OUTPUT ${_fp_out}
      COMMAND ${FLASHPORT_HIP_CLANG} ${_fp_hip_flags} --offload-arch=${arch} --cuda-device-only -S
              ${src} -o ${_fp_out}
      DEPENDS ${src} ${_fp_hip_headers}
      COMMENT "HIP device ISA: ${_fp_stem} for ${arch}" VERBATIM)
    list(APPEND _fp_hip_outputs ${_fp_out})
  endforeach()
  set(_fp_host ${_fp_hip_dir}/${_fp_stem}-host.o)
  add_custom_command(OUTPUT ${_fp_host}
    COMMAND ${FLASHPORT_HIP_CLANG} ${_fp_hip_flags} ${_fp_hip_offload} --cuda-host-only -c
            ${src} -o ${_fp_host}
    DEPENDS ${src} ${_fp_hip_headers}
    COMMENT "HIP host pass: ${_fp_stem}" VERBATIM)
  list(APPEND _fp_hip_outputs ${_fp_host})
endforeach()
add_custom_target(flashport_hip_isa ALL DEPENDS ${_fp_hip_outputs})
