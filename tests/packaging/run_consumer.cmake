# Consumes lockstep one way from a fresh directory and runs the consumer. Run as a ctest test
# (see CMakeLists.txt):
#   cmake -DMODE=subdirectory|fetchcontent|find_package|torch_subdirectory|torch_find_package|deb|conan|vcpkg
#         -DLOCKSTEP_SOURCE=<src> -DWORK_DIR=<dir> [-DGENERATOR=<gen>] [-DCXX_COMPILER=<c++>]
#         [-DTORCH_DIR=<dir of TorchConfig.cmake>]
#         [deb: -DVERSION=<x.y.z> [-DLINTIAN=<lintian>]]
#         [vcpkg: -DVERSION=<x.y.z> [-DFEATURES=mpi;...]]
#         -P run_consumer.cmake
#
# find_package runs the shell blocks of docs/building.md tagged `<!-- packaging-test: NAME -->`
# exactly as written (install, consume, tools), so the documented commands are the tested ones.
# They run with sh in WORK_DIR, where `lockstep` links to the source tree and `my_trainer` to
# tests/packaging/consumer; the only thing passed in is the environment (CXX, and PATH so that
# `cmake` is this CMake).
foreach(var MODE LOCKSTEP_SOURCE WORK_DIR)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_consumer.cmake: pass -D${var}=...")
  endif()
endforeach()

function(step what)
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${ARGN} COMMAND_ECHO STDOUT RESULT_VARIABLE rc)
  string(TIMESTAMP t1 "%s")
  math(EXPR dt "${t1} - ${t0}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "packaging (${MODE}): ${what} failed (${rc})")
  endif()
  message(STATUS "packaging (${MODE}): ${what} ok (${dt} s)")
endfunction()

function(fail msg)
  message(FATAL_ERROR "packaging (${MODE}): ${msg}")
endfunction()

file(REMOVE_RECURSE ${WORK_DIR})
file(MAKE_DIRECTORY ${WORK_DIR})
set(consumer_src ${CMAKE_CURRENT_LIST_DIR}/consumer)

# run_doc_block(<doc> <name>): runs the ```sh block of docs/<doc> tagged
# `<!-- packaging-test: <name> -->`, as written, with sh in WORK_DIR (where `lockstep` links to
# the source tree and `my_trainer` to tests/packaging/consumer).
function(run_doc_block doc name)
  set(path ${LOCKSTEP_SOURCE}/docs/${doc})
  file(READ ${path} doc_text)
  set(tag "<!-- packaging-test: ${name} -->")
  string(FIND "${doc_text}" "${tag}" at)
  string(FIND "${doc_text}" "${tag}" last REVERSE)
  if(at EQUAL -1 OR NOT at EQUAL last)
    fail("${path} must tag exactly one block with '${tag}'")
  endif()
  string(SUBSTRING "${doc_text}" ${at} -1 rest)
  if(NOT rest MATCHES "^${tag}\n```sh\n([^`]*)```")
    fail("in ${path}, '${tag}' must be followed by a ```sh block")
  endif()
  file(WRITE ${WORK_DIR}/${name}.sh "${CMAKE_MATCH_1}")
  get_filename_component(cmake_dir ${CMAKE_COMMAND} DIRECTORY)
  set(env --unset=DESTDIR PATH=${cmake_dir}:$ENV{PATH} ${doc_env})  # doc_env: the mode's own
  if(CXX_COMPILER)
    list(APPEND env CXX=${CXX_COMPILER})
  endif()
  # `sh -ex`: echo each command, stop at the first that fails.
  string(TIMESTAMP t0 "%s")
  execute_process(COMMAND ${CMAKE_COMMAND} -E env ${env} sh -ex ${WORK_DIR}/${name}.sh
                  WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE rc)
  string(TIMESTAMP t1 "%s")
  math(EXPR dt "${t1} - ${t0}")
  if(NOT rc EQUAL 0)
    fail("the '${name}' commands of docs/${doc} failed (${rc}); they are in ${WORK_DIR}/${name}.sh")
  endif()
  message(STATUS "packaging (${MODE}): docs/${doc} '${name}' commands ok (${dt} s)")
endfunction()
file(CREATE_LINK ${LOCKSTEP_SOURCE} ${WORK_DIR}/lockstep SYMBOLIC)
file(CREATE_LINK ${consumer_src} ${WORK_DIR}/my_trainer SYMBOLIC)

if(MODE STREQUAL "find_package")
  # --- the documented commands -----------------------------------------------------------
  set(prefix ${WORK_DIR}/lockstep-install)

  # 1. Configure and install, with no build.
  run_doc_block(building.md install)
  foreach(umbrella lockstep.hpp cuda.cuh mpi.hpp version.hpp)
    if(NOT EXISTS ${prefix}/include/lockstep/${umbrella})
      fail("the install lacks include/lockstep/${umbrella}")
    endif()
  endforeach()
  # Every header is installed, and nothing else is installed under include/.
  file(GLOB_RECURSE installed RELATIVE ${prefix}/include ${prefix}/include/*)
  foreach(f IN LISTS installed)
    if(NOT f MATCHES "\\.(hpp|cuh|h)$")
      fail("the install has ${prefix}/include/${f}, which is not a header")
    endif()
  endforeach()
  file(GLOB_RECURSE headers RELATIVE ${LOCKSTEP_SOURCE}/include
       ${LOCKSTEP_SOURCE}/include/*.hpp ${LOCKSTEP_SOURCE}/include/*.cuh ${LOCKSTEP_SOURCE}/include/*.h)
  list(REMOVE_ITEM headers ${installed})
  if(headers)
    fail("headers not installed: ${headers}")
  endif()
  file(GLOB tools ${prefix}/bin/*)
  if(tools)
    fail("a header-only install (no build) installed ${tools}")
  endif()
  file(GLOB_RECURSE config ${prefix}/*/lockstep-config.cmake)
  if(NOT config)
    fail("the install has no lockstep-config.cmake")
  endif()
  get_filename_component(config_dir "${config}" DIRECTORY)

  # 2. A project uses the installed package (find_package + lockstep::lockstep).
  run_doc_block(building.md consume)
  # The consumer builds one more program per optional part the package has (see its
  # CMakeLists.txt): each must be there and run, so a broken lockstep::cuda or lockstep::mpi
  # in the installed config fails here instead of being skipped.
  foreach(part cuda mpi)
    string(SUBSTRING ${part} 0 1 first)
    string(TOUPPER ${first} first)
    string(SUBSTRING ${part} 1 -1 tail)
    if(EXISTS ${config_dir}/lockstep${first}${tail}Targets.cmake)
      set(smoke ${WORK_DIR}/my_trainer-build/my_trainer_${part})
      if(NOT EXISTS ${smoke})
        fail("the package has lockstep::${part} but the consumer did not build my_trainer_${part}")
      endif()
      step("run my_trainer_${part}" ${smoke})
    else()
      message(STATUS "packaging (${MODE}): this install has no lockstep::${part}")
    endif()
  endforeach()

  # 3. Build, then install again: now the tools are installed too.
  run_doc_block(building.md tools)
  foreach(tool lockstep-run lockstep-info)
    if(NOT EXISTS ${prefix}/bin/${tool})
      fail("installing after a build did not install bin/${tool}")
    endif()
  endforeach()
  return()
endif()

set(common_args -DCMAKE_BUILD_TYPE=Release -DLOCKSTEP_ENABLE_CUDA=OFF)
if(GENERATOR)
  list(APPEND common_args -G ${GENERATOR})
endif()
if(CXX_COMPILER)
  list(APPEND common_args -DCMAKE_CXX_COMPILER=${CXX_COMPILER})
endif()

# configure_must_fail(<what> <regex> <cmake args>...): the configure fails, with exactly one
# CMake error, whose text (lines joined) matches <regex>.
function(configure_must_fail what regex)
  execute_process(COMMAND ${CMAKE_COMMAND} ${ARGN} RESULT_VARIABLE rc
                  OUTPUT_VARIABLE out ERROR_VARIABLE out)
  string(REGEX REPLACE "[ \n]+" " " flat "${out}")
  string(REGEX MATCHALL "CMake Error" errors "${out}")
  list(LENGTH errors n)
  if(rc EQUAL 0 OR NOT n EQUAL 1 OR NOT flat MATCHES "${regex}")
    message("${out}")
    fail("${what}: expected the configure to fail with one error matching '${regex}' (exit ${rc}, ${n} errors)")
  endif()
  message(STATUS "packaging (${MODE}): ${what}: fails as it should")
endfunction()

# --- the vcpkg overlay port (packaging/vcpkg), without vcpkg -------------------------------
# vcpkg is not installable offline, so its helpers are stood in for here by what they do to a
# source tree (vcpkg_check_features: features to -D options; configure and install: the real
# cmake commands), and the port's own calls run with FEATURES (-DFEATURES=mpi;...). Checked:
# the options it passes exist and configure, its CONFIG_PATH is where the install put the CMake
# package, its copyright file exists, the version in vcpkg.json is version.hpp's, and the
# consumer builds and runs against the install.
if(MODE STREQUAL "vcpkg")
  cmake_policy(SET CMP0057 NEW)  # if(IN_LIST), in this script run without cmake_minimum_required
  set(port ${LOCKSTEP_SOURCE}/packaging/vcpkg/lockstep)
  file(READ ${port}/vcpkg.json manifest)
  string(JSON port_version GET "${manifest}" version)
  if(NOT DEFINED VERSION OR NOT port_version STREQUAL VERSION)
    fail("packaging/vcpkg/lockstep/vcpkg.json says version ${port_version}, version.hpp ${VERSION}")
  endif()
  set(CURRENT_PACKAGES_DIR ${WORK_DIR}/packages)
  set(port_build ${WORK_DIR}/port-build)
  macro(vcpkg_check_features)
    cmake_parse_arguments(_f "" "OUT_FEATURE_OPTIONS" "FEATURES" ${ARGN})
    set(_opts "")
    set(_pairs ${_f_FEATURES})
    while(_pairs)
      list(POP_FRONT _pairs _feature _option)
      string(JSON _declared ERROR_VARIABLE _absent GET "${manifest}" features ${_feature})
      if(_absent)
        fail("the port maps feature '${_feature}', which vcpkg.json does not declare")
      endif()
      if(_feature IN_LIST FEATURES)
        list(APPEND _opts -D${_option}=ON)
      else()
        list(APPEND _opts -D${_option}=OFF)
      endif()
    endwhile()
    set(${_f_OUT_FEATURE_OPTIONS} ${_opts})
  endmacro()
  function(vcpkg_cmake_configure)
    cmake_parse_arguments(_c "" "SOURCE_PATH" "OPTIONS" ${ARGN})
    if(NOT _c_SOURCE_PATH STREQUAL LOCKSTEP_SOURCE)
      file(REAL_PATH "${_c_SOURCE_PATH}" _real)
      file(REAL_PATH "${LOCKSTEP_SOURCE}" _src)
      if(NOT _real STREQUAL _src)
        fail("the port's SOURCE_PATH is ${_c_SOURCE_PATH}, not the tree it lives in (${LOCKSTEP_SOURCE})")
      endif()
    endif()
    execute_process(COMMAND ${CMAKE_COMMAND} -S ${_c_SOURCE_PATH} -B ${port_build} ${common_args} ${_c_OPTIONS}
                            -DCMAKE_INSTALL_PREFIX=${CURRENT_PACKAGES_DIR}
                    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
    if(NOT rc EQUAL 0 OR out MATCHES "Manually-specified variables were not used")
      message("${out}")
      fail("the port's configure (options: ${_c_OPTIONS}) failed or passed options lockstep does not read")
    endif()
    message(STATUS "packaging (${MODE}): port: configure ok (${_c_OPTIONS})")
  endfunction()
  function(vcpkg_cmake_install)
    step("port: install" ${CMAKE_COMMAND} --install ${port_build})
  endfunction()
  function(vcpkg_cmake_config_fixup)
    cmake_parse_arguments(_x "" "CONFIG_PATH" "" ${ARGN})
    if(NOT EXISTS ${CURRENT_PACKAGES_DIR}/${_x_CONFIG_PATH}/lockstep-config.cmake)
      fail("the port's CONFIG_PATH ${_x_CONFIG_PATH} holds no lockstep-config.cmake after the install")
    endif()
    file(COPY ${CURRENT_PACKAGES_DIR}/${_x_CONFIG_PATH}/ DESTINATION ${WORK_DIR}/config-as-installed)
  endfunction()
  function(vcpkg_install_copyright)
    cmake_parse_arguments(_y "" "" "FILE_LIST" ${ARGN})
    foreach(f IN LISTS _y_FILE_LIST)
      if(NOT EXISTS ${f})
        fail("the port's copyright file ${f} does not exist")
      endif()
    endforeach()
  endfunction()
  include(${port}/portfile.cmake)
  # The consumer against the install, before vcpkg would move its config to share/lockstep.
  file(COPY ${WORK_DIR}/config-as-installed/ DESTINATION ${CURRENT_PACKAGES_DIR}/lib/cmake/lockstep)
  set(consumer_bin ${WORK_DIR}/consumer-build)
  step("configure consumer" ${CMAKE_COMMAND} -S ${consumer_src} -B ${consumer_bin} ${common_args}
       -DCMAKE_PREFIX_PATH=${CURRENT_PACKAGES_DIR})
  step("build consumer" ${CMAKE_COMMAND} --build ${consumer_bin} --target my_trainer)
  step("run my_trainer" ${consumer_bin}/my_trainer)
  if("mpi" IN_LIST FEATURES AND NOT EXISTS ${WORK_DIR}/config-as-installed/lockstepMpiTargets.cmake)
    fail("the port with feature mpi installed no lockstep::mpi")
  endif()
  return()
endif()

# --- the Conan 2 recipe (packaging/conan), offline --------------------------------------
# docs/install.md's commands as written, with a throw-away CONAN_HOME (no remote is asked:
# lockstep requires nothing), on a copy of the files the recipe exports (conan writes its test
# package's build into the tree it is given); then a C++ standard below 20 must be refused.
if(MODE STREQUAL "conan")
  file(REMOVE ${WORK_DIR}/lockstep)
  foreach(part CMakeLists.txt CHANGELOG.md README.md cmake include tools packaging)
    file(COPY ${LOCKSTEP_SOURCE}/${part} DESTINATION ${WORK_DIR}/lockstep
         PATTERN build EXCLUDE PATTERN CMakeUserPresets.json EXCLUDE)
  endforeach()
  set(doc_env CONAN_HOME=${WORK_DIR}/conan-home)
  run_doc_block(install.md conan)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env ${doc_env} conan create lockstep/packaging/conan
                          -s compiler.cppstd=17
                  WORKING_DIRECTORY ${WORK_DIR} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(rc EQUAL 0 OR NOT out MATCHES "lower than the required C\\+\\+ standard \\(20\\)")
    message("${out}")
    fail("conan create with compiler.cppstd=17 was not refused for the C++ standard (exit ${rc})")
  endif()
  message(STATUS "packaging (${MODE}): compiler.cppstd=17 refused, as it should be")
  return()
endif()

# --- the Debian packages (cpack -G DEB) ----------------------------------------------------
# Made by the commands of docs/install.md as written (a fresh build directory, the tools built,
# cpack); their control fields checked, lintian run on them (LINTIAN, when installed), unpacked
# into a throw-away root (dpkg-deb -x: no dpkg database, no root) and used from there: the tools
# run, the consumer builds against <root>/usr (a prefix the packages were not made for:
# relocatable) and runs, and a part whose dependency is missing is named when asked for.
if(MODE STREQUAL "deb")
  if(NOT DEFINED VERSION)
    fail("pass -DVERSION=<x.y.z>")
  endif()
  run_doc_block(install.md deb)
  set(out ${WORK_DIR}/lockstep-build)
  execute_process(COMMAND dpkg --print-architecture OUTPUT_VARIABLE arch OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(dev ${out}/liblockstep-dev_${VERSION}-1_all.deb)
  set(tools ${out}/lockstep-tools_${VERSION}-1_${arch}.deb)
  foreach(deb ${dev} ${tools})
    if(NOT EXISTS ${deb})
      file(GLOB made ${out}/*.deb)
      fail("cpack made no ${deb} (it made: ${made})")
    endif()
  endforeach()
  # field_is(<deb> <field> <regex>): the control field matches.
  function(field_is deb field regex)
    execute_process(COMMAND dpkg-deb -f ${deb} ${field} OUTPUT_VARIABLE v OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(NOT v MATCHES "${regex}")
      fail("${deb}: ${field} is '${v}', expected to match '${regex}'")
    endif()
  endfunction()
  field_is(${dev} Architecture "^all$")
  field_is(${dev} Version "^${VERSION}-1$")
  field_is(${dev} Depends "cmake \\(>= 3\\.25\\)")
  field_is(${dev} Suggests "libnccl-dev.*libopenmpi-dev.*libtorch-dev")
  field_is(${tools} Architecture "^${arch}$")
  field_is(${tools} Depends "libc6.*libstdc\\+\\+6")
  if(LINTIAN)
    step("lintian" ${LINTIAN} --fail-on error,warning ${dev} ${tools})
  else()
    message(STATUS "packaging (${MODE}): lintian not installed, not run (apt-get install lintian)")
  endif()
  set(root ${WORK_DIR}/root)
  foreach(deb ${dev} ${tools})
    step("unpack ${deb}" dpkg-deb -x ${deb} ${root})
  endforeach()
  execute_process(COMMAND ${root}/usr/bin/lockstep-info --version OUTPUT_VARIABLE said RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0 OR NOT said STREQUAL "lockstep ${VERSION}\n")
    fail("the packaged lockstep-info --version said '${said}' (exit ${rc}), expected 'lockstep ${VERSION}'")
  endif()
  step("run the packaged lockstep-run --help" ${root}/usr/bin/lockstep-run --help)
  # Headers, every one, and no header-only install leftovers in the tools package.
  file(GLOB_RECURSE packaged RELATIVE ${root}/usr/include ${root}/usr/include/*)
  file(GLOB_RECURSE headers RELATIVE ${LOCKSTEP_SOURCE}/include
       ${LOCKSTEP_SOURCE}/include/*.hpp ${LOCKSTEP_SOURCE}/include/*.cuh ${LOCKSTEP_SOURCE}/include/*.h)
  if(NOT packaged STREQUAL headers)
    list(REMOVE_ITEM headers ${packaged})
    fail("liblockstep-dev's headers differ from the source tree's (missing: ${headers})")
  endif()
  set(consumer_bin ${WORK_DIR}/consumer-build)
  step("configure consumer" ${CMAKE_COMMAND} -S ${consumer_src} -B ${consumer_bin} ${common_args}
       -DCMAKE_PREFIX_PATH=${root}/usr)
  step("build consumer" ${CMAKE_COMMAND} --build ${consumer_bin})
  step("run my_trainer" ${consumer_bin}/my_trainer)
  file(GLOB config_dir LIST_DIRECTORIES true ${root}/usr/lib*/cmake/lockstep)
  foreach(part Cuda Mpi)
    string(TOLOWER ${part} lower)
    if(EXISTS ${config_dir}/lockstep${part}Targets.cmake)
      if(NOT EXISTS ${consumer_bin}/my_trainer_${lower})
        fail("the package has lockstep::${lower} but the consumer did not build my_trainer_${lower}")
      endif()
      step("run my_trainer_${lower}" ${consumer_bin}/my_trainer_${lower})
    endif()
  endforeach()
  # Asked for without its dependency: the part's own message, as one error.
  if(EXISTS ${config_dir}/lockstepCudaTargets.cmake)
    configure_must_fail("COMPONENTS cuda without the CUDA toolkit"
      "lockstep::cuda needs the CUDA toolkit and NCCL, which were not found"
      -S ${consumer_src} -B ${WORK_DIR}/no-cuda-build ${common_args} -DCMAKE_PREFIX_PATH=${root}/usr
      -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON)
  endif()
  if(EXISTS ${config_dir}/lockstepMpiTargets.cmake)
    configure_must_fail("COMPONENTS mpi without MPI" "lockstep::mpi needs MPI with C\\+\\+ support, which was not found"
      -S ${consumer_src} -B ${WORK_DIR}/no-mpi-build ${common_args} -DCMAKE_PREFIX_PATH=${root}/usr
      -DCMAKE_DISABLE_FIND_PACKAGE_MPI=ON)
  endif()
  return()
endif()

# --- lockstep::torch, the consumer never calling find_package(Torch) (label torch) --------
if(MODE MATCHES "^torch_")
  set(torch_args -DLOCKSTEP_CONSUMER_TORCH=ON -DLOCKSTEP_ENABLE_MPI=OFF)
  if(TORCH_DIR)
    list(APPEND torch_args -DTorch_DIR=${TORCH_DIR})  # a libtorch found through CMAKE_PREFIX_PATH
  endif()
  set(no_torch -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON)
  set(todo "libtorch-dev.*torch\\.utils\\.cmake_prefix_path")
  set(consumer_bin ${WORK_DIR}/consumer-build)
  if(MODE STREQUAL "torch_subdirectory")
    set(sub_args -DLOCKSTEP_CONSUME=subdirectory -DLOCKSTEP_SOURCE=${LOCKSTEP_SOURCE}
                 -DCMAKE_DISABLE_FIND_PACKAGE_doctest=ON)
    # No optimisation (an empty build type): the program runs in a second, while compiling
    # libtorch's headers is most of this test's time.
    step("configure consumer" ${CMAKE_COMMAND} -S ${consumer_src} -B ${consumer_bin} ${common_args}
         ${sub_args} ${torch_args} -DCMAKE_BUILD_TYPE=)
    step("build my_trainer_torch" ${CMAKE_COMMAND} --build ${consumer_bin} --target my_trainer_torch)
    step("run my_trainer_torch" ${consumer_bin}/my_trainer_torch)
    # Without libtorch, linking lockstep::torch gives lockstep's one message saying what to do.
    configure_must_fail("linking lockstep::torch without libtorch"
      "lockstep::torch is linked by my_trainer_torch, but libtorch was not found.*${todo}"
      -S ${consumer_src} -B ${WORK_DIR}/no-torch-build ${common_args} ${sub_args} ${torch_args} ${no_torch})
  elseif(MODE STREQUAL "torch_find_package")
    set(prefix ${WORK_DIR}/lockstep-install)
    set(lockstep_args -DLOCKSTEP_BUILD_TESTS=OFF -DLOCKSTEP_BUILD_EXAMPLES=OFF
                      -DLOCKSTEP_BUILD_BENCH=OFF -DLOCKSTEP_BUILD_TOOLS=OFF)
    step("configure lockstep" ${CMAKE_COMMAND} -S ${LOCKSTEP_SOURCE} -B ${WORK_DIR}/lockstep-build
         ${common_args} ${lockstep_args} ${torch_args} -DLOCKSTEP_ENABLE_TORCH=ON)
    step("install lockstep" ${CMAKE_COMMAND} --install ${WORK_DIR}/lockstep-build --prefix ${prefix})
    step("configure consumer" ${CMAKE_COMMAND} -S ${consumer_src} -B ${consumer_bin} ${common_args}
         ${torch_args} -DCMAKE_PREFIX_PATH=${prefix})
    step("build my_trainer_torch_package" ${CMAKE_COMMAND} --build ${consumer_bin}
         --target my_trainer_torch_package)
    step("run my_trainer_torch_package" ${consumer_bin}/my_trainer_torch_package)
    # COMPONENTS torch where libtorch cannot be found now, and from a package without the part.
    configure_must_fail("COMPONENTS torch without libtorch"
      "lockstep::torch needs libtorch, which was not found.*${todo}"
      -S ${consumer_src} -B ${WORK_DIR}/no-torch-build ${common_args} ${torch_args}
      -DCMAKE_PREFIX_PATH=${prefix} ${no_torch})
    set(prefix_off ${WORK_DIR}/lockstep-install-no-torch)
    step("configure lockstep without torch" ${CMAKE_COMMAND} -S ${LOCKSTEP_SOURCE}
         -B ${WORK_DIR}/lockstep-build-no-torch ${common_args} ${lockstep_args} -DLOCKSTEP_ENABLE_MPI=OFF
         -DLOCKSTEP_ENABLE_TORCH=OFF)
    step("install lockstep without torch" ${CMAKE_COMMAND} --install ${WORK_DIR}/lockstep-build-no-torch
         --prefix ${prefix_off})
    configure_must_fail("COMPONENTS torch from a package without it"
      "This lockstep was installed without lockstep::torch.*${todo}"
      -S ${consumer_src} -B ${WORK_DIR}/no-part-build ${common_args} ${torch_args}
      -DCMAKE_PREFIX_PATH=${prefix_off})
  else()
    fail("unknown MODE '${MODE}'")
  endif()
  return()
endif()

# --- add_subdirectory / FetchContent of the source tree ---------------------------------
if(NOT MODE STREQUAL "subdirectory" AND NOT MODE STREQUAL "fetchcontent")
  fail("unknown MODE '${MODE}'")
endif()
# A subproject must not look for doctest (its tests are off there): make finding it fail.
set(consumer_bin ${WORK_DIR}/consumer-build)
step("configure consumer" ${CMAKE_COMMAND} -S ${consumer_src} -B ${consumer_bin} ${common_args}
     -DLOCKSTEP_CONSUME=${MODE} -DLOCKSTEP_SOURCE=${LOCKSTEP_SOURCE}
     -DCMAKE_DISABLE_FIND_PACKAGE_doctest=ON -DFETCHCONTENT_FULLY_DISCONNECTED=ON)
step("build consumer" ${CMAKE_COMMAND} --build ${consumer_bin})
step("run consumer" ${consumer_bin}/my_trainer)
if(EXISTS ${consumer_bin}/my_trainer_mpi)
  step("run my_trainer_mpi" ${consumer_bin}/my_trainer_mpi)
endif()
