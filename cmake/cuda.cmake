# CUDA kernels (csrc/cuda/*.cu, *.cpp): compiled when TL_CUDA=1, or when
# TL_CUDA=auto and both nvcc and cuBLASLt are found. `auto` without cuBLASLt
# stays a CPU-only build, so a plain `pip install .` on a machine that merely
# has nvcc is as fast as anywhere else.
#
#   TL_CUDA_ARCHS   CUDA architectures in CMake's form (default: 80;90-real;100-real,
#                   those nvcc knows). No kernel of ours needs an `a` target or an
#                   sm_89 instruction (FP8 conversion is the shared software math;
#                   the FP8 GEMM is cuBLASLt's own code), so sm_80 machine code
#                   serves sm_80/86/87/89 and its PTX (the plain `80`) lets the
#                   driver compile for any newer GPU the list does not name. A
#                   GPU below the list (sm_75) gets the torch fallback with a
#                   warning (_cuda_fallback.py); FP8 GEMMs below sm_89 run the
#                   tiled kernel, as cuBLASLt has no FP8 there.
#   TL_CUBLAS_ROOT  a folder with include/cublasLt.h and lib/libcublasLt.so*
#                   (default: the CUDA toolkit, then the nvidia-cublas wheel of
#                   the Python that builds)
include(CheckLanguage)

set(TL_CUDA_ARCHS "" CACHE STRING "CUDA architectures (default: 80;90-real;100-real where nvcc supports them)")
set(TL_CUBLAS_ROOT "" CACHE PATH "Folder holding include/cublasLt.h and lib/libcublasLt.so*")

# Sets TL_CUBLASLT_INCLUDE, TL_CUBLASLT_LIBRARY and TL_CUBLASLT_RPATH (a list
# of run-time search folders), or leaves TL_CUBLASLT_LIBRARY empty. `nvcc`
# locates the toolkit.
function(tl_find_cublaslt nvcc)
  set(roots)
  if(TL_CUBLAS_ROOT)
    list(APPEND roots "${TL_CUBLAS_ROOT}")
  endif()
  if(DEFINED ENV{TL_CUBLAS_ROOT})
    list(APPEND roots "$ENV{TL_CUBLAS_ROOT}")
  endif()
  get_filename_component(nvcc_real "${nvcc}" REALPATH)
  get_filename_component(nvcc_dir "${nvcc_real}" DIRECTORY)
  list(APPEND roots "${nvcc_dir}/.." "/usr/local/cuda")
  # The nvidia-cublas wheel (what PyTorch's CUDA wheels install): nvidia/cu13
  # for CUDA 13, nvidia/cublas for CUDA 12. `nvidia` is a namespace package.
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import nvidia, os; print(';'.join(os.path.join(p, s) for p in nvidia.__path__ for s in ('cu13', 'cublas')))"
    OUTPUT_VARIABLE wheel_roots OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  list(APPEND roots ${wheel_roots})
  foreach(root IN LISTS roots)
    find_path(inc cublasLt.h PATHS "${root}/include" NO_DEFAULT_PATH NO_CACHE)
    # The wheel ships only the versioned name (libcublasLt.so.13).
    file(GLOB libs "${root}/lib/libcublasLt.so*" "${root}/lib64/libcublasLt.so*"
         "${root}/targets/x86_64-linux/lib/libcublasLt.so*")
    if(inc AND libs)
      list(SORT libs)
      list(GET libs 0 lib)
      get_filename_component(libdir "${lib}" DIRECTORY)
      get_filename_component(libdir "${libdir}" REALPATH)
      set(TL_CUBLASLT_INCLUDE "${inc}" PARENT_SCOPE)
      set(TL_CUBLASLT_LIBRARY "${lib}" PARENT_SCOPE)
      # $ORIGIN-relative first: transformer_linear/_C.so next to an installed
      # nvidia/cu13/lib (torch's own CUDA wheel), then where it was found.
      set(TL_CUBLASLT_RPATH "$ORIGIN/../nvidia/cu13/lib;$ORIGIN/../nvidia/cublas/lib;${libdir}"
          PARENT_SCOPE)
      return()
    endif()
  endforeach()
  set(TL_CUBLASLT_LIBRARY "" PARENT_SCOPE)
endfunction()

# Keeps the requested architectures whose number nvcc lists (90a -> 90,
# 100-real -> 100).
function(tl_supported_archs requested out)
  execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --list-gpu-code
                  OUTPUT_VARIABLE codes OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  string(REPLACE "\n" ";" codes "${codes}")
  set(kept)
  foreach(arch IN LISTS requested)
    string(REGEX MATCH "^[0-9]+" number "${arch}")
    if("sm_${number}" IN_LIST codes)
      list(APPEND kept "${arch}")
    else()
      message(STATUS "transformer_linear: nvcc does not support sm_${number}; skipping ${arch}")
    endif()
  endforeach()
  set(${out} "${kept}" PARENT_SCOPE)
endfunction()

set(TL_WITH_CUDA OFF)
if(TL_CUDA STREQUAL "1" OR TL_CUDA STREQUAL "ON" OR TL_CUDA STREQUAL "auto")
  # cuBLASLt first: check_language compiles a test project (seconds), which a
  # CPU machine that merely has nvcc should not pay for.
  if(DEFINED ENV{CUDACXX})
    set(tl_nvcc "$ENV{CUDACXX}")
  else()
    find_program(tl_nvcc nvcc PATHS /usr/local/cuda/bin NO_CACHE)
  endif()
  if(tl_nvcc)
    tl_find_cublaslt("${tl_nvcc}")
  endif()
  set(have_nvcc OFF)
  if(tl_nvcc AND (TL_CUBLASLT_LIBRARY OR NOT TL_CUDA STREQUAL "auto"))
    check_language(CUDA)
    if(CMAKE_CUDA_COMPILER)
      set(have_nvcc ON)
    endif()
  elseif(tl_nvcc)
    set(have_nvcc ON)  # not test-compiled: without cuBLASLt `auto` stops here anyway
  endif()
  if(have_nvcc AND TL_CUBLASLT_LIBRARY)
    set(TL_WITH_CUDA ON)
  elseif(TL_CUDA STREQUAL "auto")
    if(NOT have_nvcc)
      message(STATUS "transformer_linear: no CUDA compiler found; building the CPU kernels only")
    else()
      message(STATUS "transformer_linear: nvcc found but no cuBLASLt (pip install nvidia-cublas and "
                     "build with --no-build-isolation, or set TL_CUBLAS_ROOT); building the CPU kernels "
                     "only. TL_CUDA=1 makes this an error.")
    endif()
  elseif(NOT have_nvcc)
    message(FATAL_ERROR "TL_CUDA=1 but no working CUDA compiler was found (put nvcc on PATH or set CUDACXX)")
  else()
    message(FATAL_ERROR "TL_CUDA=1 but cuBLASLt was not found: `pip install nvidia-cublas` and build "
                        "with --no-build-isolation, or set TL_CUBLAS_ROOT to a folder with "
                        "include/cublasLt.h and lib/libcublasLt.so*")
  endif()
endif()
message(STATUS "transformer_linear: CUDA kernels ${TL_WITH_CUDA}")

if(TL_WITH_CUDA)
  if(NOT TL_CUDA_ARCHS)
    set(TL_CUDA_ARCHS "80;90-real;100-real")
  endif()
  # enable_language reads CMAKE_CUDA_ARCHITECTURES; nvcc is known already.
  set(CMAKE_CUDA_ARCHITECTURES OFF)
  enable_language(CUDA)
  tl_supported_archs("${TL_CUDA_ARCHS}" archs)
  if(NOT archs)
    message(FATAL_ERROR "transformer_linear: none of TL_CUDA_ARCHS='${TL_CUDA_ARCHS}' is supported by nvcc")
  endif()
  message(STATUS "transformer_linear: CUDA architectures ${archs}, cuBLASLt ${TL_CUBLASLT_LIBRARY}")
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  file(GLOB TL_CUDA_SOURCES CONFIGURE_DEPENDS csrc/cuda/*.cu csrc/cuda/*.cpp)
  target_sources(_C PRIVATE ${TL_CUDA_SOURCES})
  # The list as compiled, for the Python side's "is there code for this GPU" check.
  string(REPLACE ";" "," archs_csv "${archs}")
  target_compile_definitions(_C PRIVATE TL_WITH_CUDA=1 "TL_CUDA_ARCH_LIST=\"${archs_csv}\"")
  target_include_directories(_C PRIVATE ${CMAKE_CUDA_TOOLKIT_INCLUDE_DIRECTORIES} "${TL_CUBLASLT_INCLUDE}")
  set_target_properties(_C PROPERTIES
    CUDA_ARCHITECTURES "${archs}"
    CUDA_RUNTIME_LIBRARY Static
    BUILD_RPATH "${TL_CUBLASLT_RPATH}"
    INSTALL_RPATH "${TL_CUBLASLT_RPATH}")
  # Bit-exact quantize: no contraction of a*b+c into an FMA (as -ffp-contract=off
  # on the host); the GEMM kernels call fmaf explicitly. No fast math, so
  # division and subnormals follow IEEE like the CPU path.
  target_compile_options(_C PRIVATE "$<$<COMPILE_LANGUAGE:CUDA>:--fmad=false;-Xcompiler=-ffp-contract=off>")
  target_link_libraries(_C PRIVATE "${TL_CUBLASLT_LIBRARY}" ${CMAKE_DL_LIBS} rt pthread)
endif()
