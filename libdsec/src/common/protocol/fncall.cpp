#include "common/protocol/fncall.hpp"

#include <fmt/format.h>

#include "common/protocol/body.hpp"

#include "common/protocol/fields_internal.hpp"

namespace dsec::protocol {

using namespace fields;

std::string_view gpu_mode_name(GpuMode mode) noexcept {
  switch (mode) {
    case GpuMode::kExclusive:
      return "exclusive";
    case GpuMode::kShared:
      return "shared";
    case GpuMode::kNone:
      break;
  }
  return "none";
}

GpuMode parse_gpu_mode(std::string_view name, std::string_view field) {
  if (name == "none" || name.empty()) return GpuMode::kNone;
  if (name == "exclusive") return GpuMode::kExclusive;
  if (name == "shared") return GpuMode::kShared;
  bad(field, fmt::format("'{}' is not a GPU mode (none, exclusive, shared)", name));
}

json encode(const FnCallRequest& r) {
  json files = json::object();
  for (const auto& [path, bytes] : r.files) files[path] = base64_encode(bytes);
  json j{{"language", r.language},
         {"code", r.code},
         {"args", r.args},
         {"files", std::move(files)},
         {"env", r.env},
         {"timeout", r.timeout_seconds},
         {"cpu_time", r.cpu_seconds},
         {"memory", r.memory_bytes},
         {"pids", r.pids},
         {"max_output_bytes", r.max_output_bytes},
         {"gpu_mode", std::string(gpu_mode_name(r.gpu_mode))},
         {"gpus", r.gpus}};
  if (!r.stdin_data.empty()) j["stdin"] = base64_encode(r.stdin_data);
  if (!r.image.empty()) j["image"] = r.image;
  if (!r.request_id.empty()) j["request_id"] = r.request_id;
  return j;
}

namespace {

// A file of a call: a relative path under its working directory, without "." or ".." components.
void validate_fncall_path(const std::string& path) {
  std::string field = fmt::format("files.{}", path);
  if (path.empty() || path.size() > kMaxPathBytes || has_nul(path))
    bad(field, fmt::format("a path must be 1 to {} bytes without NUL", kMaxPathBytes));
  if (path.front() == '/') bad(field, "must be relative (files go under the call's working directory in /tmp)");
  std::size_t start = 0;
  while (start <= path.size()) {
    std::size_t end = path.find('/', start);
    if (end == std::string::npos) end = path.size();
    std::string_view part(path.data() + start, end - start);
    if (part.empty() || part == "." || part == "..") bad(field, "must not have empty, '.' or '..' components");
    if (part.size() > 255) bad(field, "a path component is at most 255 bytes");
    start = end + 1;
  }
}

}  // namespace

FnCallRequest decode_fncall_request(const json& j) {
  if (!j.is_object()) bad("fncall", "must be a JSON object");
  FnCallRequest r;
  r.language = get_string(j, "language", "language", r.language);
  bool known = false;
  for (const char* l : kFnCallLanguages) known = known || r.language == l;
  if (!known)
    bad("language", fmt::format("'{}' is not a language of function calls (python, shell, c, cpp)", r.language));
  const json* code = find(j, "code");
  if (!code || !code->is_string()) bad("code", "required: the program's source as a string");
  r.code = code->get<std::string>();
  if (r.code.size() > kMaxFnCallCodeBytes)
    bad("code", fmt::format("{} bytes is more than the limit of {} bytes", r.code.size(), kMaxFnCallCodeBytes));
  if (has_nul(r.code)) bad("code", "must not contain NUL");
  std::size_t input = r.code.size();
  if (const json* s = find(j, "stdin")) {
    if (!s->is_string()) bad("stdin", "must be a base64 string");
    r.stdin_data = base64_decode(s->get<std::string>());
    input += r.stdin_data.size();
  }
  if (const json* a = find(j, "args")) {
    if (!a->is_array()) bad("args", "must be an array of strings");
    if (a->size() > kMaxFnCallArgs) bad("args", fmt::format("at most {} arguments", kMaxFnCallArgs));
    for (const auto& x : *a) {
      if (!x.is_string()) bad("args", "must be an array of strings");
      r.args.push_back(x.get<std::string>());
      if (has_nul(r.args.back())) bad("args", "arguments must not contain NUL");
      input += r.args.back().size();
    }
  }
  if (const json* f = find(j, "files")) {
    if (!f->is_object()) bad("files", "must be an object of path: base64 content");
    if (f->size() > kMaxFnCallFiles) bad("files", fmt::format("at most {} files", kMaxFnCallFiles));
    for (auto& [path, val] : f->items()) {
      validate_fncall_path(path);
      if (!val.is_string()) bad(fmt::format("files.{}", path), "must be a base64 string");
      std::string bytes = base64_decode(val.get<std::string>());
      input += bytes.size();
      r.files.emplace(path, std::move(bytes));
    }
  }
  if (input > kMaxFnCallInputBytes)
    bad("files", fmt::format("code, stdin, args and files together are {} bytes, more than the limit of {}", input,
                             kMaxFnCallInputBytes));
  r.env = get_string_map(j, "env", "env");
  validate_env(r.env, "env");
  r.image = get_string(j, "image", "image");
  if (!r.image.empty()) validate_image_ref(r.image, "image");
  r.timeout_seconds = get_number(j, "timeout", "timeout", r.timeout_seconds);
  if (!(r.timeout_seconds > 0) || r.timeout_seconds > kMaxFnCallTimeoutSeconds)
    bad("timeout", fmt::format("must be in (0, {}] seconds", kMaxFnCallTimeoutSeconds));
  r.cpu_seconds = get_number(j, "cpu_time", "cpu_time", r.cpu_seconds);
  if (r.cpu_seconds < 0 || r.cpu_seconds > kMaxFnCallTimeoutSeconds)
    bad("cpu_time", fmt::format("must be in [0, {}] seconds (0: the wall timeout alone)", kMaxFnCallTimeoutSeconds));
  r.memory_bytes = get_size(j, "memory", "memory", r.memory_bytes);
  if (r.memory_bytes < kMinMemoryBytes) bad("memory", "must be at least 4Mi");
  if (r.memory_bytes > kMaxFnCallMemoryBytes) bad("memory", "at most 1Ti");
  auto pids = get_unsigned(j, "pids", "pids", r.pids);
  if (pids < 1 || pids > kMaxPids) bad("pids", fmt::format("must be from 1 to {}", kMaxPids));
  r.pids = static_cast<std::uint32_t>(pids);
  r.max_output_bytes = get_size(j, "max_output_bytes", "max_output_bytes", r.max_output_bytes);
  if (r.max_output_bytes > kMaxOutputBytes) bad("max_output_bytes", "at most 1 GiB");
  r.gpu_mode = parse_gpu_mode(get_string(j, "gpu_mode", "gpu_mode", "none"));
  auto gpus = get_unsigned(j, "gpus", "gpus", 0);
  if (gpus > kMaxGpus) bad("gpus", fmt::format("at most {}", kMaxGpus));
  r.gpus = static_cast<std::uint32_t>(gpus);
  if (r.gpu_mode == GpuMode::kNone && r.gpus != 0) bad("gpus", "needs gpu_mode \"exclusive\" or \"shared\"");
  if (r.gpu_mode != GpuMode::kNone && r.gpus == 0) r.gpus = 1;
  r.request_id = get_string(j, "request_id", "request_id");
  validate_request_id(r.request_id);
  return r;
}

json encode(const FnCallResult& r) {
  json j = encode_run_outcome(r);
  j.update(json{{"oom_killed", r.oom_killed},
                {"duration", r.duration_seconds},
                {"cpu_time", r.cpu_seconds},
                {"peak_memory", r.peak_memory_bytes},
                {"compile_exit_code", r.compile_exit_code},
                {"compile_output", base64_encode(r.compile_output)},
                {"compile_seconds", r.compile_seconds},
                {"gpus", r.gpus},
                {"node", r.node}});
  return j;
}

FnCallResult decode_fncall_result(const json& j) {
  FnCallResult r;
  if (!j.is_object()) throw Error(Code::kInternal, "a function call's result is not a JSON object");
  if (auto e = j.find("error"); e != j.end() && e->is_object()) {
    r.error_code = member(*e, "code", "UNKNOWN", "error.code");
    r.error = member(*e, "message", "", "error.message");
    if (r.error.empty()) r.error = r.error_code;
    return r;
  }
  decode_run_outcome(j, r);
  r.oom_killed = member(j, "oom_killed", false);
  r.duration_seconds = member(j, "duration", 0.0);
  r.cpu_seconds = member(j, "cpu_time", 0.0);
  r.peak_memory_bytes = member(j, "peak_memory", std::uint64_t{0});
  r.compile_exit_code = member(j, "compile_exit_code", 0);
  r.compile_output = base64_decode(member(j, "compile_output", ""));
  r.compile_seconds = member(j, "compile_seconds", 0.0);
  r.gpus = member(j, "gpus", std::vector<std::string>{});
  r.node = member(j, "node", "");
  return r;
}

}  // namespace dsec::protocol
