# Writes a C++ source defining `std::string_view <FUNCTION>()` that returns the text of INPUT, so that a script
# dsec runs (the fncall zygote) ships inside the binary. Usage:
#   cmake -DINPUT=file -DOUTPUT=file.cpp -DNAMESPACE=dsec::agent::fncall -DFUNCTION=zygote_script -P embed_text.cmake
file(READ "${INPUT}" content)
string(FIND "${content}" ")DSEC_EMBED\"" clash)
if(NOT clash EQUAL -1)
  message(FATAL_ERROR "${INPUT} contains the raw string delimiter )DSEC_EMBED\"")
endif()
file(WRITE "${OUTPUT}.tmp" "// Generated from ${INPUT} by cmake/embed_text.cmake: do not edit.\n#include <string_view>\n\nnamespace ${NAMESPACE} {\n\nstd::string_view ${FUNCTION}() {\n  static constexpr std::string_view kText = R\"DSEC_EMBED(${content})DSEC_EMBED\";\n  return kText;\n}\n\n}  // namespace ${NAMESPACE}\n")
file(COPY_FILE "${OUTPUT}.tmp" "${OUTPUT}" ONLY_IF_DIFFERENT)
file(REMOVE "${OUTPUT}.tmp")
