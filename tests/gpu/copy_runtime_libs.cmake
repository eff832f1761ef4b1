# Copies the shared libraries BINARY resolves at run time into DEST, except the C runtime and the
# CUDA driver, which must come from the machine that runs it. Run with cmake -P.
file(GET_RUNTIME_DEPENDENCIES
  EXECUTABLES ${BINARY}
  RESOLVED_DEPENDENCIES_VAR resolved
  UNRESOLVED_DEPENDENCIES_VAR unresolved
  PRE_EXCLUDE_REGEXES "^libc\\.so" "^libm\\.so" "^libdl\\.so" "^libpthread\\.so" "^librt\\.so"
                      "^ld-linux" "^libcuda\\.so" "^linux-vdso"
  POST_EXCLUDE_REGEXES "/libc\\.so" "/libm\\.so" "/libdl\\.so" "/libpthread\\.so" "/librt\\.so"
                       "/ld-linux" "/libcuda\\.so")
file(MAKE_DIRECTORY ${DEST})
foreach(lib ${resolved})
  get_filename_component(name ${lib} NAME)
  # Copy the file behind the link under the name the loader asks for.
  file(REAL_PATH ${lib} real)
  if(NOT EXISTS ${DEST}/${name} OR ${real} IS_NEWER_THAN ${DEST}/${name})
    file(COPY_FILE ${real} ${DEST}/${name} ONLY_IF_DIFFERENT)
  endif()
endforeach()
