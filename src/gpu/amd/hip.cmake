# HIP build for AMD GPUs: compile-verified and ISA-checked, never run here (no AMD GPU is
# reachable). Included by src/gpu/CMakeLists.txt when FLASHPORT_HIP=ON.
#
# clang (>= 19, Debian's clang-19) compiles the HIP sources with Debian's HIP 5.2 headers and
# runtime; scripts/hip_toolchain.sh installs them and makes the device-library folder
# (FLASHPORT_HIP_DEVICE_LIBS) that also holds the targets Debian lacks (gfx942, gfx1100, gfx1201).
#   - kernel sources compile once for all FLASHPORT_HIP_ARCHS into a fat object (host code +
#     one code object per target); -save-temps keeps the device assembly of each target as
#     <build>/hip_isa/<source>-hip-amdgcn-amd-amdhsa-<gfx>.s, the very ISA that is in the object
#     (scripts/check_amd_isa.sh reads it);
#   - host-only sources (the backend) compile as plain host objects;
# and the objects join the flashport library with the HIP runtime (libamdhip64), so dispatch
# offers hip_backend() (FLASHPORT_WITH_HIP).
set(FLASHPORT_HIP_ARCHS "gfx90a;gfx942;gfx1100;gfx1201" CACHE STRING "AMD targets (gfx names)")
set(FLASHPORT_HIP_DEVICE_LIBS "${PROJECT_SOURCE_DIR}/build-hip-toolchain/bitcode" CACHE PATH
    "Device-library folder with oclc_isa_version_<gfx>.bc for every target (scripts/hip_toolchain.sh)")
find_program(FLASHPORT_HIP_CLANG NAMES clang++ PATHS /usr/lib/llvm-19/bin NO_DEFAULT_PATH)
find_program(FLASHPORT_HIP_CLANG NAMES clang++-19)
find_library(FLASHPORT_HIP_RUNTIME NAMES amdhip64)
if(NOT FLASHPORT_HIP_CLANG OR NOT FLASHPORT_HIP_RUNTIME OR NOT EXISTS /usr/include/hip/hip_runtime.h)
  message(FATAL_ERROR "flashport HIP: clang++-19, libamdhip64 or the HIP headers not found "
                      "(run scripts/hip_toolchain.sh)")
endif()
foreach(arch IN LISTS FLASHPORT_HIP_ARCHS)
  string(REGEX REPLACE "^gfx" "" _fp_isa "${arch}")
  if(NOT EXISTS "${FLASHPORT_HIP_DEVICE_LIBS}/oclc_isa_version_${_fp_isa}.bc")
    message(FATAL_ERROR "flashport HIP: ${FLASHPORT_HIP_DEVICE_LIBS}/oclc_isa_version_${_fp_isa}.bc "
                        "is missing (scripts/hip_toolchain.sh makes it)")
  endif()
endforeach()

# Kernel instances: the forward main loop shared with CUDA (fwd_kernel.cuh) on the AMD tile rows,
# head dims 64/128/256 x fp16/bf16 (fwd_launch.hpp: kAmdFwdInstances), the aux kernels shared
# with CUDA (aux_kernels.cu, compiled as HIP: merge/split combine, merge backward, KV-cache append
# and rotary-q x fp16/bf16), and the backward shared with CUDA (bwd_amd.hip: bwd_kernel.cuh on the
# AMD backward rows x fp16/bf16, preprocess, dq conversion, sink gradient; kAmdBwdInstances).
set(FLASHPORT_HIP_KERNEL_SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/amd/fwd_amd.hip
                                 ${CMAKE_CURRENT_SOURCE_DIR}/common/aux_kernels.cu
                                 ${CMAKE_CURRENT_SOURCE_DIR}/amd/bwd_amd.hip)
set(FLASHPORT_HIP_HOST_SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/amd/hip_backend.hip)
set(FLASHPORT_HIP_INSTANCES 21)  # forward 6 + aux 6 + backward 6 + backward aux 3
list(LENGTH FLASHPORT_HIP_ARCHS _fp_hip_narch)
message(STATUS "flashport HIP: ${FLASHPORT_HIP_INSTANCES} kernel instances x ${_fp_hip_narch} targets "
               "(${FLASHPORT_HIP_ARCHS}) with ${FLASHPORT_HIP_CLANG}; compile-verified, not run")

string(REPLACE ";" "," _fp_hip_archs "${FLASHPORT_HIP_ARCHS}")
set(_fp_hip_flags
  -x hip -std=c++20 -O3 -fPIC -Wall -Wextra
  --rocm-path=/usr "--rocm-device-lib-path=${FLASHPORT_HIP_DEVICE_LIBS}"
  -I/usr/include -D__HIP_PLATFORM_AMD__ -include hip/hip_runtime.h
  -I${PROJECT_SOURCE_DIR}/include -I${PROJECT_SOURCE_DIR}/src
  "-DFLASHPORT_GPU_ARCHS=\"${_fp_hip_archs}\"")
set(_fp_hip_offload)
foreach(arch IN LISTS FLASHPORT_HIP_ARCHS)
  list(APPEND _fp_hip_offload --offload-arch=${arch})
endforeach()

set(_fp_hip_dir ${CMAKE_BINARY_DIR}/hip_isa)
file(MAKE_DIRECTORY ${_fp_hip_dir})
file(GLOB _fp_hip_headers ${CMAKE_CURRENT_SOURCE_DIR}/*/*.hpp ${CMAKE_CURRENT_SOURCE_DIR}/*/*.cuh
                          ${PROJECT_SOURCE_DIR}/src/core/*.hpp ${PROJECT_SOURCE_DIR}/include/flashport/*.h)
set(_fp_hip_objects)
set(_fp_hip_isa)
foreach(src IN LISTS FLASHPORT_HIP_KERNEL_SOURCES)
  get_filename_component(_fp_stem ${src} NAME_WE)
  set(_fp_obj ${_fp_hip_dir}/${_fp_stem}.o)
  set(_fp_asm)
  foreach(arch IN LISTS FLASHPORT_HIP_ARCHS)
    list(APPEND _fp_asm ${_fp_hip_dir}/${_fp_stem}-hip-amdgcn-amd-amdhsa-${arch}.s)
  endforeach()
  add_custom_command(OUTPUT ${_fp_obj} BYPRODUCTS ${_fp_asm}
    COMMAND ${FLASHPORT_HIP_CLANG} ${_fp_hip_flags} ${_fp_hip_offload} -save-temps=obj -c ${src} -o ${_fp_obj}
    DEPENDS ${src} ${_fp_hip_headers}
    COMMENT "HIP kernels: ${_fp_stem} for ${_fp_hip_archs}" VERBATIM)
  list(APPEND _fp_hip_objects ${_fp_obj})
  list(APPEND _fp_hip_isa ${_fp_asm})
endforeach()
foreach(src IN LISTS FLASHPORT_HIP_HOST_SOURCES)
  get_filename_component(_fp_stem ${src} NAME_WE)
  set(_fp_obj ${_fp_hip_dir}/${_fp_stem}.o)
  add_custom_command(OUTPUT ${_fp_obj}
    COMMAND ${FLASHPORT_HIP_CLANG} ${_fp_hip_flags} ${_fp_hip_offload} --cuda-host-only -c ${src} -o ${_fp_obj}
    DEPENDS ${src} ${_fp_hip_headers}
    COMMENT "HIP host code: ${_fp_stem}" VERBATIM)
  list(APPEND _fp_hip_objects ${_fp_obj})
endforeach()

# The objects (and only they) are what scripts/check_amd_isa.sh needs: one target builds them.
add_custom_target(flashport_hip_objects DEPENDS ${_fp_hip_objects})
set_source_files_properties(${_fp_hip_objects} PROPERTIES EXTERNAL_OBJECT TRUE GENERATED TRUE)
target_sources(flashport PRIVATE ${_fp_hip_objects})
add_dependencies(flashport flashport_hip_objects)
target_compile_definitions(flashport PRIVATE FLASHPORT_WITH_HIP=1)
target_link_libraries(flashport PUBLIC ${FLASHPORT_HIP_RUNTIME})
