// The HTTP(S) blob store: blobs and refs as plain resources under a base URL, read with GET (Range for chunks),
// written with PUT and DELETE (nginx's dav module or an object store), listed through nginx's JSON autoindex.
//
// Every request goes through one libcurl easy handle taken from a small pool, so threads reading chunks at once each
// get a handle and the handles keep their keep-alive connections between requests. Every transfer is bounded: a
// connect timeout, an overall timeout that grows with the bytes it moves (at 1 MiB/s), and a low-speed limit, so a
// server that stalls costs a bounded wait and never a hang. Bodies are capped at what the caller asked for.
#include <fcntl.h>
#include <strings.h>
#include <sys/stat.h>
#include <unistd.h>

#include <curl/curl.h>

#include <algorithm>
#include <cctype>
#include <climits>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "dsec/retry.hpp"
#include "http/curl.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/digest.hpp"
#include "image/store/manifest.hpp"

namespace dsec::image {
namespace {

namespace curl = http::curl;
using curl::set;

using std::chrono::milliseconds;

constexpr std::size_t kMaxIdleHandles = 16;
constexpr std::uint64_t kMaxRefBytes = 4096;
constexpr std::uint64_t kMaxListingBytes = 256u << 20;
constexpr std::size_t kMaxErrorBodyBytes = 512;
// A transfer may take max(request_timeout, bytes / kSlowestRate); one that moves less than kLowSpeedLimit bytes/s for
// request_timeout is cut.
constexpr std::uint64_t kSlowestRate = 1u << 20;
constexpr long kLowSpeedLimit = 1024;
// Between attempts: 50 ms, doubling, at most 1 s.
const RetryPolicy kRetryBackoff{
    .initial_backoff = milliseconds{50}, .max_backoff = milliseconds{1000}, .multiplier = 2.0};

// Where a PUT's body comes from. rewind() starts it over (a retry, or curl resending on a fresh connection).
class UploadSource {
 public:
  virtual ~UploadSource() = default;
  virtual std::uint64_t size() const = 0;
  virtual void rewind() = 0;
  // Fills up to `n` bytes; throws to abort the upload.
  virtual std::size_t read(char* buf, std::size_t n) = 0;
};

class BytesSource final : public UploadSource {
 public:
  explicit BytesSource(std::string_view bytes) : bytes_(bytes) {}
  std::uint64_t size() const override { return bytes_.size(); }
  void rewind() override { pos_ = 0; }
  std::size_t read(char* buf, std::size_t n) override {
    n = std::min(n, bytes_.size() - pos_);
    std::memcpy(buf, bytes_.data() + pos_, n);
    pos_ += n;
    return n;
  }

 private:
  std::string_view bytes_;
  std::size_t pos_ = 0;
};

// A file streamed as it is read, hashed on the way: if what was read does not hash to the digest (the file changed
// after it was checked), the upload is aborted before its last byte, so the server never completes the PUT and the
// wrong bytes never appear under the digest's name.
class FileSource final : public UploadSource {
 public:
  FileSource(int fd, std::uint64_t size, std::string digest, std::string what)
      : fd_(fd), size_(size), digest_(std::move(digest)), what_(std::move(what)) {}
  std::uint64_t size() const override { return size_; }
  void rewind() override {
    pos_ = 0;
    hash_ = Sha256();
  }
  std::size_t read(char* buf, std::size_t n) override {
    n = static_cast<std::size_t>(std::min<std::uint64_t>(n, size_ - pos_));
    if (n == 0) return 0;
    ssize_t got = retry_eintr([&] { return ::pread(fd_, buf, n, static_cast<off_t>(pos_)); });
    if (got < 0) throw_errno_fmt(errno, "{}: read", what_);
    if (got == 0)
      throw Error(Code::kDataLoss,
                  fmt::format("{}: the file shrank to {} bytes while it was sent ({} expected)", what_, pos_, size_));
    hash_.update(buf, static_cast<std::size_t>(got));
    pos_ += static_cast<std::uint64_t>(got);
    if (pos_ == size_) {
      std::string actual = hash_.finish();
      if (actual != digest_)
        throw Error(Code::kDataLoss, fmt::format("{}: the file changed while it was sent: it now hashes to {}, not {}",
                                                 what_, actual, digest_));
    }
    return static_cast<std::size_t>(got);
  }

 private:
  int fd_;
  std::uint64_t size_;
  std::string digest_;
  std::string what_;
  std::uint64_t pos_ = 0;
  Sha256 hash_;
};

struct Transfer {
  const char* method = "GET";  // GET, HEAD, PUT, DELETE
  std::string url;
  std::string range;                   // "a-b" for a Range request
  std::uint64_t max_body = 64u << 10;  // a 2xx body longer than this aborts the transfer (Outcome::overflow)
  bool abort_on_200 = false;           // a range request past offset 0: a 200 (the whole blob) is useless, stop at once
  UploadSource* upload = nullptr;      // PUT body
  bool if_none_match = false;          // PUT only if nothing is there yet (If-None-Match: *)
  std::uint64_t expected_bytes = 0;    // what the transfer moves, for its timeout
};

struct Outcome {
  CURLcode result = CURLE_OK;
  std::string curl_error;
  long status = 0;
  std::string body;       // the 2xx body, else the first bytes of the error body
  bool overflow = false;  // a 2xx body longer than Transfer::max_body
  bool whole_instead_of_range = false;
  std::string content_range;
  curl_off_t content_length = -1;
  std::exception_ptr upload_error;
  int attempts = 0;
};

struct Exchange {
  CURL* handle;
  const Transfer* transfer;
  Outcome* outcome;
};

bool success(long status) { return status >= 200 && status < 300; }

std::size_t on_body(char* data, std::size_t size, std::size_t count, void* user) {
  auto* ex = static_cast<Exchange*>(user);
  const std::size_t n = size * count;
  Outcome& o = *ex->outcome;
  const long status = curl::response_code(ex->handle);
  if (!success(status)) {
    if (o.body.size() < kMaxErrorBodyBytes) o.body.append(data, std::min(n, kMaxErrorBodyBytes - o.body.size()));
    return n;
  }
  if (status == 200 && ex->transfer->abort_on_200) {
    o.whole_instead_of_range = true;
    return 0;  // anything but n: curl stops the transfer and drops the connection
  }
  curl_off_t announced = -1;
  curl_easy_getinfo(ex->handle, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &announced);
  if ((announced > 0 && static_cast<std::uint64_t>(announced) > ex->transfer->max_body) ||
      o.body.size() + n > ex->transfer->max_body) {
    o.overflow = true;
    return 0;
  }
  if (o.body.empty() && announced > 0) o.body.reserve(static_cast<std::size_t>(announced));
  o.body.append(data, n);
  return n;
}

std::size_t on_header(char* data, std::size_t size, std::size_t count, void* user) {
  auto* ex = static_cast<Exchange*>(user);
  const std::size_t n = size * count;
  std::string_view line(data, n);
  if (line.starts_with("HTTP/")) {
    ex->outcome->content_range.clear();  // a new response (after a 100 Continue): forget the last one's headers
  } else if (line.size() > 14 && strncasecmp(line.data(), "content-range:", 14) == 0) {
    line.remove_prefix(14);
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.front()))) line.remove_prefix(1);
    while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.remove_suffix(1);
    ex->outcome->content_range = std::string(line);
  }
  return n;
}

std::size_t on_upload(char* buf, std::size_t size, std::size_t count, void* user) {
  auto* ex = static_cast<Exchange*>(user);
  try {
    return ex->transfer->upload->read(buf, size * count);
  } catch (...) {
    ex->outcome->upload_error = std::current_exception();
    return CURL_READFUNC_ABORT;
  }
}

int on_seek(void* user, curl_off_t offset, int origin) {
  auto* ex = static_cast<Exchange*>(user);
  if (offset != 0 || origin != SEEK_SET) return CURL_SEEKFUNC_CANTSEEK;
  ex->transfer->upload->rewind();
  return CURL_SEEKFUNC_OK;
}

// Worth another attempt: the store could not be reached, cut the transfer, stalled, or said it is overloaded.
bool transient(const Outcome& o) {
  if (o.upload_error || o.overflow || o.whole_instead_of_range) return false;
  if (o.result != CURLE_OK) {
    const curl::Failure f = curl::classify(o.result);
    return f == curl::Failure::kUnreachable || f == curl::Failure::kTimedOut || f == curl::Failure::kBroken;
  }
  if (o.status == 408 || o.status == 429) return true;
  return o.status >= 500 && o.status != 501 && o.status != 505 && o.status != 507;
}

// "bytes a-b/total" -> {a, b, total}; total is -1 for "*".
struct ContentRange {
  std::int64_t first = -1, last = -1, total = -1;
};
std::optional<ContentRange> parse_content_range(std::string_view v) {
  if (!v.starts_with("bytes ")) return std::nullopt;
  v.remove_prefix(6);
  ContentRange r;
  auto num = [](std::string_view s, std::int64_t& out) {
    if (s.empty() || s.size() > 19) return false;
    std::int64_t x = 0;
    for (char c : s) {
      if (c < '0' || c > '9') return false;
      x = x * 10 + (c - '0');
    }
    out = x;
    return true;
  };
  auto slash = v.find('/');
  if (slash == std::string_view::npos) return std::nullopt;
  std::string_view span = v.substr(0, slash), total = v.substr(slash + 1);
  if (total != "*" && !num(total, r.total)) return std::nullopt;
  if (span == "*") return r;
  auto dash = span.find('-');
  if (dash == std::string_view::npos || !num(span.substr(0, dash), r.first) || !num(span.substr(dash + 1), r.last))
    return std::nullopt;
  return r;
}

class HttpStore final : public BlobStore {
 public:
  HttpStore(std::string base, std::string display, StoreOptions options)
      : base_(std::move(base)), display_(std::move(display)), options_(std::move(options)) {}

  const std::string& url() const override { return display_; }

  bool has_blob(const std::string& digest) override { return blob_size(digest).has_value(); }

  std::string read_blob(const std::string& digest, std::uint64_t max_size) override {
    Transfer t;
    t.url = blob_url(digest);
    t.max_body = max_size;
    t.expected_bytes = max_size;
    Outcome o = perform(t);
    if (o.overflow)
      throw Error(
          Code::kResourceExhausted,
          fmt::format("GET {}: the blob is larger than the {} bytes a reader takes here", shown(t.url), max_size));
    if (o.status != 200) fail(t, o);
    std::string actual = sha256_digest(o.body);
    if (actual != digest)
      throw Error(Code::kDataLoss, fmt::format("GET {}: the {} bytes served hash to {}, not to the digest they are "
                                               "stored under: the store's copy is corrupt",
                                               shown(t.url), o.body.size(), actual));
    return std::move(o.body);
  }

  std::string read_range(const std::string& digest, std::uint64_t offset, std::uint64_t length) override {
    if (length > std::numeric_limits<std::uint64_t>::max() - offset)
      throw Error(Code::kOutOfRange,
                  fmt::format("read_range {}: offset {} + length {} overflows", digest, offset, length));
    if (length == 0) {
      auto size = blob_size(digest);
      if (!size) throw Error(Code::kNotFound, fmt::format("HEAD {}: HTTP 404", shown(blob_url(digest))));
      if (*size < offset) throw out_of_range(blob_url(digest), offset, length, static_cast<std::int64_t>(*size));
      return {};
    }
    Transfer t;
    t.url = blob_url(digest);
    t.range = fmt::format("{}-{}", offset, offset + length - 1);
    t.max_body = length;
    t.abort_on_200 = offset != 0;
    t.expected_bytes = length;
    Outcome o = perform(t);
    if (o.status == 416) {
      auto cr = parse_content_range(o.content_range);
      throw out_of_range(t.url, offset, length, cr ? cr->total : -1);
    }
    if (o.whole_instead_of_range || (o.status == 200 && o.overflow))
      throw Error(Code::kUnimplemented,
                  fmt::format("GET {} (Range: bytes={}): the server answered 200 with the whole blob instead of 206 "
                              "with the range: this HTTP store does not serve ranges",
                              shown(t.url), t.range));
    if (o.overflow)
      throw Error(Code::kDataLoss, fmt::format("GET {} (Range: bytes={}): the server sent more than the {} bytes "
                                               "asked for",
                                               shown(t.url), t.range, length));
    if (o.status == 200) {
      // Only a server that ignored Range answers 200; its whole blob is the range only from 0 to its end.
      if (o.body.size() == length) return std::move(o.body);
      throw out_of_range(t.url, offset, length, static_cast<std::int64_t>(o.body.size()));
    }
    if (o.status != 206) fail(t, o);
    auto cr = parse_content_range(o.content_range);
    if (o.body.size() < length) {
      if (cr && cr->total >= 0 && static_cast<std::uint64_t>(cr->total) < offset + length)
        throw out_of_range(t.url, offset, length, cr->total);
      throw Error(Code::kDataLoss,
                  fmt::format("GET {} (Range: bytes={}): 206 with {} bytes instead of {} ({})", shown(t.url), t.range,
                              o.body.size(), length, o.content_range.empty() ? "no Content-Range" : o.content_range));
    }
    if (cr && cr->first >= 0 && static_cast<std::uint64_t>(cr->first) != offset)
      throw Error(Code::kDataLoss, fmt::format("GET {} (Range: bytes={}): the server sent another range ({})",
                                               shown(t.url), t.range, o.content_range));
    return std::move(o.body);
  }

  void put_blob_file(const std::string& digest, const std::filesystem::path& file) override {
    const std::string what = fmt::format("put_blob_file {} from {}", digest, file.string());
    digest_hex(digest, "blob digest");
    UniqueFd fd(::open(file.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) throw_errno_fmt(errno, "{}: open", what);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) throw_errno_fmt(errno, "{}: stat", what);
    if (!S_ISREG(st.st_mode)) throw Error(Code::kInvalidArgument, fmt::format("{}: not a regular file", what));
    std::string actual = sha256_file(file);
    if (actual != digest)
      throw Error(Code::kDataLoss,
                  fmt::format("{}: the file hashes to {}, not to the digest it would be stored under", what, actual));
    FileSource source(fd.get(), static_cast<std::uint64_t>(st.st_size), digest, what);
    put_blob_from(digest, source);
  }

  void put_blob(const std::string& digest, std::string_view bytes) override {
    digest_hex(digest, "blob digest");
    std::string actual = sha256_digest(bytes);
    if (actual != digest)
      throw Error(Code::kDataLoss, fmt::format("put_blob {}: the {} bytes given hash to {}, not to the digest they "
                                               "would be stored under",
                                               digest, bytes.size(), actual));
    BytesSource source(bytes);
    put_blob_from(digest, source);
  }

  void remove_blob(const std::string& digest) override {
    Transfer t;
    t.method = "DELETE";
    t.url = blob_url(digest);
    Outcome o = perform(t);
    if (o.status == 404) return;  // gone already: removal is idempotent
    if (!success(o.status)) fail(t, o);
  }

  std::vector<BlobInfo> list_blobs() override {
    std::vector<BlobInfo> out;
    for (const auto& e : list_directory(base_ + "/blobs/sha256/")) {
      std::string digest = "sha256:" + e.name;
      if (e.type != "file" || !is_digest(digest)) continue;
      out.push_back(BlobInfo{std::move(digest), e.size, e.mtime});
    }
    std::sort(out.begin(), out.end(), [](const BlobInfo& a, const BlobInfo& b) { return a.digest < b.digest; });
    return out;
  }

  std::optional<std::string> read_ref(const std::string& tagged) override {
    Transfer t;
    t.url = ref_url(tagged);
    t.max_body = kMaxRefBytes;
    Outcome o = perform(t);
    if (o.status == 404) return std::nullopt;
    if (o.overflow)
      throw Error(Code::kDataLoss, fmt::format("GET {}: more than {} bytes: not a ref (a ref holds one manifest "
                                               "digest)",
                                               shown(t.url), kMaxRefBytes));
    if (o.status != 200) fail(t, o);
    std::string_view text = o.body;
    while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.remove_suffix(1);
    if (!is_digest(text))
      throw Error(Code::kDataLoss,
                  fmt::format("GET {}: the ref holds '{}', not a manifest digest", shown(t.url), text.substr(0, 100)));
    return std::string(text);
  }

  void write_ref(const std::string& tagged, const std::string& manifest_digest) override {
    digest_hex(manifest_digest, "manifest digest");
    put_ref(tagged, manifest_digest, false);
  }

  bool create_ref(const std::string& tagged, const std::string& manifest_digest) override {
    digest_hex(manifest_digest, "manifest digest");
    if (read_ref(tagged)) return false;
    return put_ref(tagged, manifest_digest, true);
  }

  bool remove_ref(const std::string& tagged) override {
    Transfer t;
    t.method = "DELETE";
    t.url = ref_url(tagged);
    Outcome o = perform(t);
    if (o.status == 404) return false;
    if (!success(o.status)) fail(t, o);
    return true;
  }

  std::vector<std::string> list_refs() override {
    std::vector<std::string> out;
    for (const auto& e : list_directory(base_ + "/refs/")) {
      if (e.type != "file") continue;
      try {
        ImageReference ref = parse_reference(unescape_reference(e.name));
        if (ref.digest.empty() && escape_reference(ref.tagged()) == e.name) out.push_back(ref.tagged());
      } catch (const Error&) {
        // Not a ref dsec wrote (a stray file): not listed.
      }
    }
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  struct Entry {
    std::string name, type;
    std::uint64_t size = 0;
    double mtime = 0;
  };

  std::string blob_url(const std::string& digest) const {
    return base_ + "/blobs/sha256/" + digest_hex(digest, "blob digest");
  }

  std::string ref_url(const std::string& tagged) const {
    ImageReference ref = parse_reference(tagged);
    if (!ref.digest.empty())
      throw Error(Code::kInvalidArgument,
                  fmt::format("ref '{}': a ref is a name and tag, without a pinned digest", tagged));
    return base_ + "/refs/" + curl::url_escape(escape_reference(ref.tagged()));
  }

  // PUTs `manifest_digest` as the ref of `tagged`, with `if_none_match` only where no ref is yet: false when the
  // server saw one appear (412), true when it took the write; any other failure throws. write_ref and create_ref.
  bool put_ref(const std::string& tagged, const std::string& manifest_digest, bool if_none_match) {
    const std::string body = manifest_digest + "\n";
    BytesSource source(body);
    Transfer t;
    t.method = "PUT";
    t.url = ref_url(tagged);
    t.upload = &source;
    t.expected_bytes = body.size();
    t.if_none_match = if_none_match;
    Outcome o = perform(t);
    if (if_none_match && o.status == 412) return false;  // the server saw the tag appear since the look
    if (!success(o.status)) fail(t, o);
    return true;
  }

  // The URL as messages show it: the store's URL as the user named it (no credentials), then the path below it.
  std::string shown(const std::string& url) const { return display_ + url.substr(base_.size()); }

  std::optional<std::uint64_t> blob_size(const std::string& digest) {
    Transfer t;
    t.method = "HEAD";
    t.url = blob_url(digest);
    Outcome o = perform(t);
    if (o.status == 404) return std::nullopt;
    if (o.status != 200) fail(t, o);
    return o.content_length >= 0 ? static_cast<std::uint64_t>(o.content_length) : 0;
  }

  void put_blob_from(const std::string& digest, UploadSource& source) {
    if (auto size = blob_size(digest); size && *size == source.size()) return;  // there already
    Transfer t;
    t.method = "PUT";
    t.url = blob_url(digest);
    t.upload = &source;
    t.expected_bytes = source.size();
    Outcome o = perform(t);
    if (!success(o.status)) fail(t, o);
  }

  std::vector<Entry> list_directory(const std::string& url) {
    Transfer t;
    t.url = url;
    t.max_body = kMaxListingBytes;
    t.expected_bytes = 1u << 20;
    Outcome o = perform(t);
    if (o.status == 404) return {};  // nothing was ever stored there
    auto unlisted = [&](const std::string& why) {
      return Error(Code::kUnimplemented,
                   fmt::format("GET {}: {}: this HTTP store does not list its contents (an nginx store lists with "
                               "`autoindex on; autoindex_format json;`)",
                               shown(url), why));
    };
    if (o.overflow) throw unlisted(fmt::format("a listing of more than {} bytes", kMaxListingBytes));
    if (o.status == 401 || o.status == 403 || o.status == 405 || o.status == 501)
      throw unlisted(fmt::format("HTTP {}", o.status));
    if (o.status != 200) fail(t, o);
    nlohmann::json doc = nlohmann::json::parse(o.body, nullptr, /*allow_exceptions=*/false);
    if (!doc.is_array()) throw unlisted("the answer is not nginx's JSON autoindex");
    std::vector<Entry> out;
    out.reserve(doc.size());
    for (const auto& item : doc) {
      if (!item.is_object() || !item.contains("name") || !item["name"].is_string() || !item.contains("type") ||
          !item["type"].is_string())
        throw unlisted("the answer is not nginx's JSON autoindex");
      Entry e;
      e.name = item["name"].get<std::string>();
      e.type = item["type"].get<std::string>();
      if (auto it = item.find("size"); it != item.end() && it->is_number_unsigned()) e.size = it->get<std::uint64_t>();
      if (auto it = item.find("mtime"); it != item.end() && it->is_string()) {
        time_t when = curl_getdate(it->get<std::string>().c_str(), nullptr);
        if (when > 0) e.mtime = static_cast<double>(when);
      }
      out.push_back(std::move(e));
    }
    return out;
  }

  Error out_of_range(const std::string& url, std::uint64_t offset, std::uint64_t length, std::int64_t size) const {
    std::string have = size >= 0 ? fmt::format("the blob has {} bytes", size) : "the blob is shorter";
    return Error(Code::kOutOfRange,
                 fmt::format("GET {}: bytes {}..{} asked for, {}", shown(url), offset, offset + length, have));
  }

  // The error for a transfer that did not end as its caller wanted.
  [[noreturn]] void fail(const Transfer& t, const Outcome& o) const {
    std::string head = fmt::format("{} {}", t.method, shown(t.url));
    if (!t.range.empty()) head += fmt::format(" (Range: bytes={})", t.range);
    std::string tries = o.attempts > 1 ? fmt::format(" (after {} attempts)", o.attempts) : "";
    if (o.result != CURLE_OK) {
      std::string what = curl::describe(o.result, o.curl_error.c_str());
      switch (curl::classify(o.result)) {
        case curl::Failure::kUntrustedCertificate:
          throw Error(Code::kUnavailable,
                      fmt::format("{}: the server's TLS certificate is not trusted ({}); give the CA that signed it "
                                  "as the store's ca_file",
                                  head, what),
                      /*retryable=*/false);
        case curl::Failure::kBadCaFile:
          throw Error(Code::kInvalidArgument,
                      fmt::format("{}: the CA file '{}' cannot be used ({})", head, options_.ca_file, what));
        case curl::Failure::kUnsupportedProtocol:
        case curl::Failure::kMalformedUrl:
          throw Error(Code::kInvalidArgument, fmt::format("{}: {}", head, what));
        default:
          throw Error(Code::kUnavailable, fmt::format("{}: {}{}", head, what, tries));
      }
    }
    std::string detail = fmt::format("{}: HTTP {}", head, o.status);
    switch (o.status) {
      case 404:
        throw Error(Code::kNotFound, detail);
      case 416:
        throw Error(Code::kOutOfRange, detail);
      case 401:
        throw Error(Code::kUnauthenticated, detail + " (the store wants credentials)");
      case 403:
        throw Error(Code::kPermissionDenied, detail);
      case 405:
      case 501:
        throw Error(Code::kUnimplemented, fmt::format("{} (the server does not do {} here)", detail, t.method));
      case 413:
      case 507:
        throw Error(Code::kResourceExhausted, detail + " (the store has no room for it)");
      default:
        break;
    }
    if (transient(o)) throw Error(Code::kUnavailable, detail + tries);
    if (o.status >= 300 && o.status < 400)
      throw Error(Code::kFailedPrecondition, detail + " (redirects are not followed: name the store by its final URL)");
    throw Error(Code::kFailedPrecondition, detail);
  }

  Outcome perform(const Transfer& t) {
    for (int attempt = 1;; ++attempt) {
      if (t.upload) t.upload->rewind();
      Outcome o = perform_once(t);
      o.attempts = attempt;
      if (o.upload_error) std::rethrow_exception(o.upload_error);
      if (!transient(o) || attempt >= options_.attempts) return o;
      const milliseconds backoff = kRetryBackoff.backoff_cap(attempt + 1);
      std::this_thread::sleep_for(backoff);
    }
  }

  Outcome perform_once(const Transfer& t) {
    curl::HandlePool::Lease lease(handles_);
    CURL* h = lease.get();
    Outcome o;
    Exchange ex{h, &t, &o};
    char errbuf[CURL_ERROR_SIZE] = {0};
    curl::HeaderList headers;
    headers.add("Expect:");
    if (t.if_none_match) headers.add("If-None-Match: *");

    const long request_ms = static_cast<long>(options_.request_timeout.count());
    const long scaled_ms =
        static_cast<long>(std::min<std::uint64_t>(t.expected_bytes / kSlowestRate * 1000, LONG_MAX / 2));
    curl::start_transfer(h, {.url = t.url.c_str(),
                             .user_agent = "dsec-image-store/0.1.0",
                             .ca_file = options_.ca_file.c_str(),
                             .headers = &headers,
                             .error_buffer = errbuf});
    set(h, CURLOPT_CONNECTTIMEOUT_MS, static_cast<long>(options_.connect_timeout.count()));
    set(h, CURLOPT_TIMEOUT_MS, std::max(request_ms, scaled_ms));
    set(h, CURLOPT_LOW_SPEED_LIMIT, kLowSpeedLimit);
    set(h, CURLOPT_LOW_SPEED_TIME, std::max(1L, (request_ms + 999) / 1000));
    set(h, CURLOPT_WRITEFUNCTION, &on_body);
    set(h, CURLOPT_WRITEDATA, static_cast<void*>(&ex));
    set(h, CURLOPT_HEADERFUNCTION, &on_header);
    set(h, CURLOPT_HEADERDATA, static_cast<void*>(&ex));
    if (!t.range.empty()) set(h, CURLOPT_RANGE, t.range.c_str());
    std::string_view method = t.method;
    if (method == "HEAD") {
      set(h, CURLOPT_NOBODY, 1L);
    } else if (method == "PUT") {
      set(h, CURLOPT_UPLOAD, 1L);
      set(h, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(t.upload->size()));
      set(h, CURLOPT_READFUNCTION, &on_upload);
      set(h, CURLOPT_READDATA, static_cast<void*>(&ex));
      set(h, CURLOPT_SEEKFUNCTION, &on_seek);
      set(h, CURLOPT_SEEKDATA, static_cast<void*>(&ex));
    } else if (method == "DELETE") {
      set(h, CURLOPT_CUSTOMREQUEST, "DELETE");
    } else {
      set(h, CURLOPT_HTTPGET, 1L);
    }

    o.result = curl_easy_perform(h);
    o.curl_error = errbuf;
    o.status = curl::response_code(h);
    curl_easy_getinfo(h, CURLINFO_CONTENT_LENGTH_DOWNLOAD_T, &o.content_length);
    // What our own callbacks stopped is reported through the outcome's flags, not as a transport failure.
    if (o.result == CURLE_WRITE_ERROR && (o.overflow || o.whole_instead_of_range)) o.result = CURLE_OK;
    if (o.result == CURLE_ABORTED_BY_CALLBACK && o.upload_error) o.result = CURLE_OK;
    if (o.result != CURLE_OK) o.status = 0;
    if (o.result != CURLE_OK) lease.discard();
    return o;
  }

  const std::string base_;     // no trailing '/'
  const std::string display_;  // for messages
  const StoreOptions options_;
  curl::HandlePool handles_{kMaxIdleHandles};  // each keeps its connection for the next transfer
};

}  // namespace

std::unique_ptr<BlobStore> open_http_store(std::string_view url, const StoreOptions& options) {
  curl::global_init("the HTTP image store");
  const std::string given(url);
  auto bad = [&](const std::string& why) {
    return Error(Code::kInvalidArgument, fmt::format("HTTP store '{}': {}", given, why));
  };
  if (options.attempts < 1) throw bad(fmt::format("attempts must be at least 1, not {}", options.attempts));
  if (options.connect_timeout.count() <= 0 || options.request_timeout.count() <= 0)
    throw bad("connect and request timeouts must be positive");
  if (!options.ca_file.empty() && ::access(options.ca_file.c_str(), R_OK) != 0)
    throw bad(fmt::format("the CA file '{}' cannot be read: {}", options.ca_file, std::strerror(errno)));
  if (given.find_first_of("?#") != std::string::npos) throw bad("a store URL has no query or fragment");

  struct UrlFree {
    CURLU* u;
    ~UrlFree() { curl_url_cleanup(u); }
  } parsed{curl_url()};
  if (!parsed.u) throw Error(Code::kResourceExhausted, "curl_url failed (out of memory?)");
  if (CURLUcode rc = curl_url_set(parsed.u, CURLUPART_URL, given.c_str(), 0); rc != CURLUE_OK)
    throw bad(curl_url_strerror(rc));
  char* scheme = nullptr;
  if (curl_url_get(parsed.u, CURLUPART_SCHEME, &scheme, 0) != CURLUE_OK || !scheme) throw bad("no scheme");
  std::string s(scheme);
  curl_free(scheme);
  if (s != "http" && s != "https") throw bad("an HTTP store's URL starts with http:// or https://");
  char* host = nullptr;
  if (curl_url_get(parsed.u, CURLUPART_HOST, &host, 0) != CURLUE_OK || !host || !*host) {
    curl_free(host);
    throw bad("no host");
  }
  curl_free(host);

  std::string base = given;
  while (!base.empty() && base.back() == '/') base.pop_back();
  // Messages never show credentials written into the URL.
  std::string display = base;
  char* user = nullptr;
  if (curl_url_get(parsed.u, CURLUPART_USER, &user, 0) == CURLUE_OK && user) {
    curl_free(user);
    curl_url_set(parsed.u, CURLUPART_USER, nullptr, 0);
    curl_url_set(parsed.u, CURLUPART_PASSWORD, nullptr, 0);
    char* redacted = nullptr;
    if (curl_url_get(parsed.u, CURLUPART_URL, &redacted, 0) == CURLUE_OK && redacted) {
      display = redacted;
      curl_free(redacted);
      while (!display.empty() && display.back() == '/') display.pop_back();
    }
  }
  return std::make_unique<HttpStore>(std::move(base), std::move(display), options);
}

}  // namespace dsec::image
