#include "client/fncall_placement.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <functional>
#include <queue>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "dsec/error.hpp"

namespace dsec::detail {
namespace {

constexpr std::size_t kNodesNamedInErrors = 16;

std::uint32_t count_of(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return 0;
  double v = it->get<double>();
  return v > 0 ? static_cast<std::uint32_t>(std::min(v, 4.0e9)) : 0;
}

std::vector<std::string> strings_of(const nlohmann::json& j, const char* key) {
  std::vector<std::string> out;
  auto it = j.find(key);
  if (it == j.end() || !it->is_array()) return out;
  for (const auto& x : *it)
    if (x.is_string()) out.push_back(x.get<std::string>());
  return out;
}

// "name:tag" of a reference without its digest; "name" alone means "name:latest".
std::string_view without_digest(std::string_view ref) { return ref.substr(0, ref.find('@')); }

bool same_name(std::string_view a, std::string_view b) {
  auto tagged = [](std::string_view r) {
    std::size_t slash = r.rfind('/');
    std::size_t colon = r.rfind(':');
    return colon != std::string_view::npos && (slash == std::string_view::npos || colon > slash);
  };
  if (a == b) return true;
  if (tagged(a) == tagged(b)) return false;
  std::string_view plain = tagged(a) ? b : a, with_tag = tagged(a) ? a : b;
  return with_tag.size() == plain.size() + 7 && with_tag.starts_with(plain) && with_tag.ends_with(":latest");
}

}  // namespace

std::optional<FnCallNodeState> parse_fncall_node_state(const nlohmann::json& node_info) {
  if (!node_info.is_object()) return std::nullopt;
  auto it = node_info.find("fncall");
  if (it == node_info.end() || !it->is_object()) return std::nullopt;
  const auto& f = *it;
  FnCallNodeState s;
  s.languages = strings_of(f, "languages");
  s.gpus = strings_of(f, "gpus");
  s.gpu_shares = count_of(f, "gpu_shares");
  s.gpus_free = count_of(f, "gpus_free");
  if (auto u = f.find("gpu_usage"); u != f.end() && u->is_array()) {
    for (const auto& d : *u) {
      if (!d.is_object() || d.value("exclusive", false) == true) continue;
      std::uint32_t used = count_of(d, "shares_used");
      if (used < s.gpu_shares) s.shares_free += s.gpu_shares - used;
    }
  }
  if (auto d = f.find("default_image"); d != f.end() && d->is_string()) s.default_image = d->get<std::string>();
  if (auto p = f.find("pools"); p != f.end() && p->is_array()) {
    for (const auto& x : *p) {
      if (!x.is_object()) continue;
      FnCallPool pool;
      if (auto i = x.find("image"); i != x.end() && i->is_string()) pool.image = i->get<std::string>();
      if (auto l = x.find("language"); l != x.end() && l->is_string()) pool.language = l->get<std::string>();
      pool.idle = count_of(x, "idle");
      pool.busy = count_of(x, "busy");
      pool.min = count_of(x, "min");
      pool.max = count_of(x, "max");
      s.pools.push_back(std::move(pool));
    }
  }
  return s;
}

bool same_fncall_image(std::string_view pool_image, std::string_view call_image, std::string_view default_image) {
  if (call_image.empty()) {
    if (pool_image.empty()) return true;
    return !default_image.empty() && same_fncall_image(pool_image, default_image);
  }
  if (pool_image.empty()) return !default_image.empty() && same_fncall_image(default_image, call_image);
  std::size_t pa = pool_image.find('@'), ca = call_image.find('@');
  if (pa != std::string_view::npos && ca != std::string_view::npos)
    return pool_image.substr(pa) == call_image.substr(ca);
  return same_name(without_digest(pool_image), without_digest(call_image));
}

FnCallCandidate fncall_candidate(std::string id, bool healthy, bool info_known,
                                 const std::vector<std::string>& backends, std::uint32_t cores, double load1,
                                 const std::optional<FnCallNodeState>& state, const FnCallNeeds& needs, int in_flight) {
  const std::string_view language = needs.language, image = needs.image;
  FnCallCandidate c;
  c.id = std::move(id);
  c.healthy = healthy && info_known;
  c.capacity = std::max(1.0, static_cast<double>(cores));
  double busy = 0;
  if (info_known && std::find(backends.begin(), backends.end(), "fncall") == backends.end()) {
    c.serves = false;
    c.refusal = fmt::format("does not serve function calls (serves: {})",
                            backends.empty() ? std::string("nothing") : fmt::format("{}", fmt::join(backends, ", ")));
  }
  if (state) {
    if (c.serves && !state->languages.empty() &&
        std::find(state->languages.begin(), state->languages.end(), language) == state->languages.end()) {
      c.serves = false;
      c.refusal =
          fmt::format("language: does not serve '{}' (serves: {})", language, fmt::join(state->languages, ", "));
    }
    if (c.serves && needs.gpu_mode == GpuMode::kExclusive && state->gpus.size() < needs.gpus) {
      c.serves = false;
      c.refusal = fmt::format("gpus: hands {} GPUs to calls, {} wanted exclusive", state->gpus.size(), needs.gpus);
    } else if (c.serves && needs.gpu_mode == GpuMode::kShared &&
               (state->gpus.empty() || (state->gpu_shares > 0 && needs.gpus > state->gpu_shares))) {
      c.serves = false;
      c.refusal = state->gpus.empty() ? std::string("gpus: hands no GPU to calls")
                                      : fmt::format("gpus: {} shares of a GPU wanted, it cuts each into {}", needs.gpus,
                                                    state->gpu_shares);
    }
    if (needs.gpu_mode == GpuMode::kExclusive) c.gpus_free = state->gpus_free >= needs.gpus;
    if (needs.gpu_mode == GpuMode::kShared) c.gpus_free = state->shares_free >= needs.gpus;
    for (const auto& p : state->pools) {
      busy += p.busy;
      if (p.language == language && same_fncall_image(p.image, image, state->default_image)) {
        c.warm = true;
        c.warm_idle += p.idle;
      }
    }
  }
  c.load = std::max(busy, std::max(0.0, load1)) + std::max(0, in_flight);
  return c;
}

std::vector<std::size_t> place_fncalls(const std::vector<FnCallCandidate>& nodes, std::size_t count,
                                       std::string_view seed) {
  if (count == 0) return {};
  struct Entry {
    double score;
    std::size_t rank;
    std::size_t index;
    bool operator<(const Entry& o) const {  // max-heap: higher score first, then lower rank
      if (score != o.score) return score < o.score;
      return rank > o.rank;
    }
  };
  const std::size_t n = nodes.size();
  const std::size_t offset = n == 0 ? 0 : std::hash<std::string_view>{}(seed) % n;
  std::vector<double> picks(n, 0);
  auto score = [&](std::size_t i) {
    const auto& c = nodes[i];
    return (c.capacity - c.load - picks[i] - 1) / c.capacity + (c.warm ? kWarmPoolWeight : 0.0) +
           (c.gpus_free ? kGpuFreeWeight : 0.0);
  };
  std::priority_queue<Entry> heap;
  std::size_t healthy = 0;
  std::vector<std::string> refusals;
  for (std::size_t i = 0; i < n; ++i) {
    const auto& c = nodes[i];
    if (!c.healthy) {
      refusals.push_back(fmt::format("{}: unhealthy (unreachable, ejected or not reported yet)", c.id));
      continue;
    }
    ++healthy;
    if (!c.serves) {
      refusals.push_back(fmt::format("{}: {}", c.id, c.refusal));
      continue;
    }
    heap.push(Entry{score(i), (i + n - offset) % n, i});
  }
  if (heap.empty()) {
    if (refusals.size() > kNodesNamedInErrors) {
      std::size_t more = refusals.size() - kNodesNamedInErrors;
      refusals.resize(kNodesNamedInErrors);
      refusals.push_back(fmt::format("and {} more", more));
    }
    std::string why =
        refusals.empty() ? std::string("this client has no node") : fmt::format("{}", fmt::join(refusals, "; "));
    if (healthy == 0) throw Error(Code::kUnavailable, fmt::format("no node can take function calls now: {}", why));
    throw Error(Code::kFailedPrecondition, fmt::format("no node serves this function call: {}", why));
  }
  std::vector<std::size_t> out;
  out.reserve(count);
  for (std::size_t k = 0; k < count; ++k) {
    Entry e = heap.top();
    heap.pop();
    out.push_back(e.index);
    picks[e.index] += 1;
    e.score = score(e.index);
    heap.push(e);
  }
  return out;
}

}  // namespace dsec::detail
