# Sanitizer and fuzzing build modes (RELIABILITY.md §A5, issue 9). Host (C/C++) code only: CUDA sources
# never get these flags (ASan breaks cudaMalloc without protect_shadow_gap=0, and nvcc does not take them).
#
#   -DPERIGEE_SANITIZE=address   ASan + UBSan, no recovery (the first report aborts the test), frame pointers
#   -DPERIGEE_SANITIZE=thread    TSan (run the concurrency tests with OMP_NUM_THREADS=1: libgomp is not
#                                instrumented, so OpenMP regions would report false races)
#   -DPERIGEE_FUZZ=ON            clang only: every library compiled with -fsanitize=fuzzer-no-link,address,undefined,
#                                and the libFuzzer targets in tests/fuzz linked with -fsanitize=fuzzer
# Scripts: scripts/test-sanitizers.sh (build-asan, build-tsan) and scripts/fuzz.sh (build-fuzz).
set(PERIGEE_SANITIZE "" CACHE STRING "Sanitizer build: '' (none), 'address' (ASan+UBSan) or 'thread' (TSan)")
set_property(CACHE PERIGEE_SANITIZE PROPERTY STRINGS "" address thread)
option(PERIGEE_FUZZ "Build the libFuzzer targets in tests/fuzz (clang; implies ASan+UBSan)" OFF)

set(_pg_host "$<OR:$<COMPILE_LANGUAGE:CXX>,$<COMPILE_LANGUAGE:C>>")
# ASan/TSan builds: -O1 -g1 (they come after the build type's -O2 -g, so they win). -g1 keeps the line tables,
# so every report still names file:line; it drops the local-variable debug info, which no report uses. Measured
# on the 2-core CI machine (test_server.cpp, one file alone): -O2 -g 157 s, -O1 -g 112 s, -O1 -g1 64 s; with -O2 -g the
# whole ASan build was 36 of the ~93 minutes of a cold-cache rehearsal of .ci/run (session 10's landing took 78), with
# -O1 -g1 15. -O1 is what the ASan and TSan manuals recommend for reports with usable stacks.
set(_pg_san_opt -O1 -g1)
set(_pg_san_flags "")
if(PERIGEE_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "PERIGEE_FUZZ needs clang (libFuzzer); configure with CXX=clang++-14 CC=clang-14")
  endif()
  if(PERIGEE_SANITIZE AND NOT PERIGEE_SANITIZE STREQUAL "address")
    message(FATAL_ERROR "PERIGEE_FUZZ builds with ASan+UBSan; PERIGEE_SANITIZE=${PERIGEE_SANITIZE} cannot be combined")
  endif()
  set(_pg_san_flags -fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g)
  # Link-time: ASan/UBSan runtimes for every executable; the fuzz targets add -fsanitize=fuzzer themselves.
  add_link_options(-fsanitize=address,undefined)
elseif(PERIGEE_SANITIZE STREQUAL "address")
  set(_pg_san_flags -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer ${_pg_san_opt})
  add_link_options(-fsanitize=address,undefined)
elseif(PERIGEE_SANITIZE STREQUAL "thread")
  set(_pg_san_flags -fsanitize=thread -fno-omit-frame-pointer ${_pg_san_opt})
  add_link_options(-fsanitize=thread)
elseif(PERIGEE_SANITIZE)
  message(FATAL_ERROR "PERIGEE_SANITIZE must be '', 'address' or 'thread', not '${PERIGEE_SANITIZE}'")
endif()

if(_pg_san_flags)
  if(PERIGEE_CUDA)
    message(FATAL_ERROR "sanitizer/fuzz builds are CPU-only: configure them with -DPERIGEE_CUDA=OFF")
  endif()
  add_compile_options("$<${_pg_host}:${_pg_san_flags}>")
  # Some warnings only appear with sanitizer instrumentation or clang (e.g. GCC's -Wmaybe-uninitialized
  # under -fsanitize=address); they are still printed, but a sanitizer build must not fail on them —
  # the normal Release build is the -Werror gate.
  list(APPEND PERIGEE_WARNINGS -Wno-error)
  message(STATUS "perigee: sanitizer build (${PERIGEE_SANITIZE}${PERIGEE_FUZZ}): ${_pg_san_flags}")
endif()
