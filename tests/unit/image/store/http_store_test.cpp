// The HTTP(S) image store against a real nginx (started by the test from /usr/sbin/nginx with a private prefix):
// blobs and refs over GET/Range/PUT/DELETE, JSON autoindex listings, corruption, concurrency, and stores that vanish,
// stall or misbehave. Skips, saying why, where nginx (with its dav module) is not installed.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <curl/curl.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "error_test_util.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/digest.hpp"
#include "image/store/manifest.hpp"

namespace dsec::image {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

// A fresh directory under $TMPDIR (or /tmp), removed with everything in it when the test ends.
class TempDir {
 public:
  TempDir() {
    const char* base = std::getenv("TMPDIR");
    std::string templ = std::string(base && *base ? base : "/tmp") + "/dsec-http-store-test-XXXXXX";
    if (::mkdtemp(templ.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    path_ = templ;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& rel) const { return path_ / rel; }

 private:
  fs::path path_;
};

void write_text(const fs::path& p, const std::string& text) {
  fs::create_directories(p.parent_path());
  std::ofstream out(p, std::ios::trunc | std::ios::binary);
  out << text;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

constexpr const char* kNginx = "/usr/sbin/nginx";

// The message of the dsec::Error f() throws; empty when it throws none.
std::string message_of(const std::function<void()>& f) {
  std::optional<Error> e = dsec::test::thrown(f);
  return e ? e->what() : std::string();
}

std::string random_bytes(std::size_t n, unsigned seed) {
  std::mt19937_64 rng(seed);
  std::string out(n, '\0');
  for (std::size_t i = 0; i < n; i += 8) {
    std::uint64_t v = rng();
    std::memcpy(out.data() + i, &v, std::min<std::size_t>(8, n - i));
  }
  return out;
}

std::string run_capture(const std::string& command) {
  std::string out;
  FILE* p = ::popen(command.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  std::size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

// Why a private nginx cannot run here, or empty.
std::string nginx_skip_reason() {
  if (::access(kNginx, X_OK) != 0)
    return std::string("nginx is not installed at ") + kNginx + " (Debian: apt-get install nginx-light)";
  if (run_capture(std::string(kNginx) + " -V 2>&1").find("http_dav_module") == std::string::npos)
    return std::string(kNginx) + " was built without the dav module (PUT/DELETE)";
  return {};
}

// One line of the fixture's access log.
struct LoggedRequest {
  std::string method, uri, range;
  int status = 0;
  std::uint64_t bytes_sent = 0;
  std::uint64_t connection = 0;           // nginx's serial number of the connection
  std::uint64_t connection_requests = 0;  // 1 for a request on a fresh connection
};

// A private nginx serving a directory as a dsec store on 127.0.0.1 (the C++ twin of
// tests/integration/nginx_store.py): PUT/DELETE through the dav module, JSON autoindex, its own prefix for config,
// pid, logs and temp files (never /etc/nginx), an access log with the Range header and status of every request. The
// listening socket is bound here and handed to nginx (its NGINX environment variable), so the port is known and
// nobody can take it between start()s.
class NginxStore {
 public:
  struct Config {
    bool tls = false;
    std::string autoindex = "json";  // "json", "html" (autoindex_format html) or "off"
    std::string location_extra;      // more directives inside `location /`
    std::string server_extra;        // more directives (locations) inside `server`
  };

  NginxStore(fs::path root, Config config) : root_(std::move(root)), config_(std::move(config)) {}
  ~NginxStore() { stop(); }
  NginxStore(const NginxStore&) = delete;
  NginxStore& operator=(const NginxStore&) = delete;

  std::string url() const {
    return std::string(config_.tls ? "https" : "http") + "://127.0.0.1:" + std::to_string(port_);
  }
  std::string ca_file() const { return (prefix_.path() / "tls" / "cert.pem").string(); }
  const fs::path& root() const { return root_; }
  int port() const { return port_; }

  // Starts nginx (again, on the same port, after go_away()) and waits until it answers a request.
  void start() {
    if (pid_ > 0) return;
    fs::create_directories(root_ / ".tmp");
    fs::create_directories(prefix_.path() / "tmp");
    if (config_.tls && !fs::exists(ca_file())) make_certificate();

    UniqueFd sock(::socket(AF_INET, SOCK_STREAM, 0));  // no CLOEXEC: nginx inherits it
    ASSERT_TRUE(sock) << std::strerror(errno);
    int one = 1;
    ::setsockopt(sock.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(port_));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::bind(sock.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << std::strerror(errno);
    ASSERT_EQ(::listen(sock.get(), 511), 0);
    socklen_t len = sizeof addr;
    ::getsockname(sock.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    const fs::path conf = prefix_.path() / "nginx.conf";
    write_text(conf, config_text());

    // Everything the child needs is made before fork: it only dup2s, setsids and execs.
    std::string nginx_env = "NGINX=" + std::to_string(sock.get()) + ";";
    std::string path_env = "PATH=/usr/sbin:/usr/bin:/sbin:/bin";
    std::string prefix = prefix_.path().string(), conf_s = conf.string(), err = (prefix_.path() / "error.log").string();
    std::vector<char*> argv = {const_cast<char*>(kNginx),
                               const_cast<char*>("-p"),
                               prefix.data(),
                               const_cast<char*>("-c"),
                               conf_s.data(),
                               const_cast<char*>("-e"),
                               err.data(),
                               nullptr};
    std::vector<char*> envp = {nginx_env.data(), path_env.data(), nullptr};
    UniqueFd out(::open((prefix_.path() / "stderr.log").c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644));
    UniqueFd devnull(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0) << std::strerror(errno);
    if (pid == 0) {
      ::setsid();  // its own process group: go_away() and stop() kill the master and its workers together
      ::dup2(devnull.get(), 0);
      ::dup2(out.get(), 1);
      ::dup2(out.get(), 2);
      ::execve(kNginx, argv.data(), envp.data());
      ::_exit(127);
    }
    pid_ = pid;
    sock.reset();
    wait_ready();
  }

  // The store vanishes at once: SIGKILL to nginx and its workers; transfers in flight are cut, connections refused.
  void go_away() {
    if (pid_ <= 0) return;
    ::kill(-pid_, SIGKILL);
    reap();
  }

  // Graceful stop (SIGQUIT), SIGKILL for whatever is left after a few seconds; nothing of it runs afterwards.
  void stop() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGQUIT);
    for (auto deadline = Clock::now() + 5s; Clock::now() < deadline;) {
      if (::waitpid(pid_, nullptr, WNOHANG) == pid_) {
        ::kill(-pid_, SIGKILL);  // a worker that outlived its master
        wait_group_gone();
        pid_ = -1;
        return;
      }
      std::this_thread::sleep_for(10ms);
    }
    ::kill(-pid_, SIGKILL);
    reap();
  }

  static constexpr const char* kReadyProbe = "/.dsec-ready";

  std::vector<LoggedRequest> requests() const {
    std::vector<LoggedRequest> out;
    std::istringstream in(read_text(prefix_.path() / "access.log"));
    std::string line;
    while (std::getline(in, line)) {
      std::vector<std::string> f;
      std::size_t start = 0;
      for (std::size_t tab; (tab = line.find('\t', start)) != std::string::npos; start = tab + 1)
        f.push_back(line.substr(start, tab - start));
      f.push_back(line.substr(start));
      if (f.size() != 7 || f[1] == kReadyProbe) continue;
      LoggedRequest r;
      r.method = f[0];
      r.uri = f[1];
      r.status = std::stoi(f[2]);
      r.range = f[3] == "-" ? "" : f[3];
      r.bytes_sent = std::stoull(f[4]);
      r.connection = std::stoull(f[5]);
      r.connection_requests = std::stoull(f[6]);
      out.push_back(r);
    }
    return out;
  }

  // Requests for kReadyProbe (start()'s own) are not listed.
  // nginx logs a request just after its response went out: wait until `count` are there (or the timeout passes).
  std::vector<LoggedRequest> wait_for_requests(std::size_t count, std::chrono::milliseconds timeout = 2s) const {
    auto deadline = Clock::now() + timeout;
    for (;;) {
      auto reqs = requests();
      if (reqs.size() >= count || Clock::now() >= deadline) return reqs;
      std::this_thread::sleep_for(5ms);
    }
  }

  // Empties the access log once it has stopped growing (the last answered request's line is in).
  void clear_requests() const {
    const fs::path log = prefix_.path() / "access.log";
    std::error_code ec;
    for (auto deadline = Clock::now() + 2s; Clock::now() < deadline;) {
      auto before = fs::file_size(log, ec);
      std::this_thread::sleep_for(30ms);
      if (fs::file_size(log, ec) == before) break;
    }
    ::truncate(log.c_str(), 0);
  }

  std::string log_tail() const {
    return read_text(prefix_.path() / "stderr.log") + read_text(prefix_.path() / "error.log");
  }

 private:
  std::string config_text() const {
    const std::string p = prefix_.path().string(), r = root_.string();
    std::string listen = "listen 127.0.0.1:" + std::to_string(port_) + (config_.tls ? " ssl;" : ";");
    std::string tls =
        config_.tls ? "    ssl_certificate " + p + "/tls/cert.pem;\n    ssl_certificate_key " + p + "/tls/key.pem;\n"
                    : "";
    return (::geteuid() == 0 ? std::string("user root root;\n") : std::string()) +
           "daemon off;\nmaster_process on;\nworker_processes 1;\n"
           "pid " +
           p + "/nginx.pid;\nerror_log " + p +
           "/error.log info;\n"
           "events { worker_connections 1024; }\n"
           "http {\n"
           "  types { }\n  default_type application/octet-stream;\n"
           "  log_format dsec_store \"$request_method\\t$request_uri\\t$status\\t$http_range\\t$body_bytes_sent\\t"
           "$connection\\t$connection_requests\";\n"
           "  access_log " +
           p +
           "/access.log dsec_store;\n"
           "  client_body_temp_path " +
           r +
           "/.tmp/nginx-body;\n"
           "  proxy_temp_path " +
           p + "/tmp/proxy;\n  fastcgi_temp_path " + p +
           "/tmp/fastcgi;\n"
           "  uwsgi_temp_path " +
           p + "/tmp/uwsgi;\n  scgi_temp_path " + p +
           "/tmp/scgi;\n"
           "  client_max_body_size 0;\n  keepalive_timeout 75s;\n  keepalive_requests 100000;\n"
           "  server {\n    " +
           listen + "\n" + tls + "    root " + r + ";\n" + config_.server_extra +
           "\n    location / {\n"
           "      dav_methods PUT DELETE;\n      create_full_put_path on;\n      dav_access user:rw group:r all:r;\n" +
           (config_.autoindex == "off" ? std::string("      autoindex off;\n")
                                       : "      autoindex on;\n      autoindex_format " + config_.autoindex + ";\n") +
           config_.location_extra + "\n    }\n  }\n}\n";
  }

  void make_certificate() {
    fs::create_directories(prefix_.path() / "tls");
    const std::string d = (prefix_.path() / "tls").string();
    std::string cmd = "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -keyout " + d + "/key.pem -out " + d +
                      "/cert.pem -subj /CN=127.0.0.1 -addext subjectAltName=IP:127.0.0.1,DNS:localhost 2>&1";
    std::string out = run_capture(cmd);
    ASSERT_TRUE(fs::exists(ca_file())) << "openssl could not make a test certificate: " << out;
  }

  // Ready when a worker answers a real request (the kernel accepts into the inherited socket before that).
  void wait_ready() {
    curl_global_init(CURL_GLOBAL_DEFAULT);
    const std::string probe = url() + kReadyProbe;
    for (auto deadline = Clock::now() + 10s; Clock::now() < deadline;) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        pid_ = -1;
        FAIL() << "nginx exited at start (status " << status << "):\n" << log_tail();
      }
      CURL* h = curl_easy_init();
      curl_easy_setopt(h, CURLOPT_URL, probe.c_str());
      curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
      curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, 1000L);
      curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
      if (config_.tls) curl_easy_setopt(h, CURLOPT_CAINFO, ca_file().c_str());
      CURLcode rc = curl_easy_perform(h);
      curl_easy_cleanup(h);
      if (rc == CURLE_OK) return;
      std::this_thread::sleep_for(20ms);
    }
    FAIL() << "nginx did not answer on port " << port_ << ":\n" << log_tail();
  }

  void reap() {
    ::waitpid(pid_, nullptr, 0);
    wait_group_gone();
    pid_ = -1;
  }

  // Workers of a SIGKILLed master linger for a moment; the group is empty once they are gone.
  void wait_group_gone() {
    for (auto deadline = Clock::now() + 5s; Clock::now() < deadline;) {
      if (::kill(-pid_, 0) != 0 && errno == ESRCH) return;
      std::this_thread::sleep_for(5ms);
    }
    ADD_FAILURE() << "nginx process group " << pid_ << " still has members after SIGKILL";
  }

  fs::path root_;
  Config config_;
  TempDir prefix_;
  int port_ = 0;
  pid_t pid_ = -1;
};

// A TCP server on 127.0.0.1 that misbehaves: with kNeverAccept it listens and never accepts (the kernel completes
// the handshake, the request sits in a buffer); with kStallMidBody it answers every request with the headers of a
// 206 and a few body bytes, then goes silent.
class StallingServer {
 public:
  enum Mode { kNeverAccept, kStallMidBody };
  explicit StallingServer(Mode mode) : mode_(mode) {
    sock_.reset(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::bind(sock_.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 || ::listen(sock_.get(), 64) != 0)
      throw std::runtime_error(std::string("stalling server: ") + std::strerror(errno));
    socklen_t len = sizeof addr;
    ::getsockname(sock_.get(), reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
    int p[2];
    if (::pipe2(p, O_CLOEXEC) != 0) throw std::runtime_error("pipe2");
    stop_read_.reset(p[0]);
    stop_write_.reset(p[1]);
    if (mode_ == kStallMidBody) thread_ = std::thread([this] { serve(); });
  }
  ~StallingServer() {
    (void)!::write(stop_write_.get(), "x", 1);
    if (thread_.joinable()) thread_.join();
  }
  std::string url() const { return "http://127.0.0.1:" + std::to_string(port_); }
  int accepted() const { return accepted_; }

 private:
  void serve() {
    std::vector<UniqueFd> conns;
    for (;;) {
      std::vector<pollfd> fds = {{stop_read_.get(), POLLIN, 0}, {sock_.get(), POLLIN, 0}};
      for (auto& c : conns) fds.push_back({c.get(), POLLIN, 0});
      if (::poll(fds.data(), fds.size(), 10000) <= 0) return;  // bounded: gives up after 10 s of silence
      if (fds[0].revents) return;
      if (fds[1].revents & POLLIN) {
        UniqueFd c(::accept4(sock_.get(), nullptr, nullptr, SOCK_CLOEXEC));
        if (c) {
          ++accepted_;
          conns.push_back(std::move(c));
        }
      }
      for (std::size_t i = 2; i < fds.size(); ++i) {
        if (!(fds[i].revents & POLLIN)) continue;
        char buf[4096];
        ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
        if (n <= 0) continue;
        static constexpr char kAnswer[] =
            "HTTP/1.1 206 Partial Content\r\nContent-Length: 100000\r\nContent-Range: bytes 0-99999/100000\r\n\r\n"
            "0123456789";
        (void)!::write(fds[i].fd, kAnswer, sizeof kAnswer - 1);
      }
    }
  }

  Mode mode_;
  UniqueFd sock_, stop_read_, stop_write_;
  int port_ = 0;
  std::atomic<int> accepted_{0};
  std::thread thread_;
};

class HttpStore : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string reason = nginx_skip_reason();
    if (!reason.empty()) GTEST_SKIP() << reason;
  }

  // Starts nginx serving a fresh directory (extra config as given) and opens a store on it.
  NginxStore& serve(NginxStore::Config config = {}) {
    servers_.push_back(
        std::make_unique<NginxStore>(dir_.path() / ("root" + std::to_string(servers_.size())), std::move(config)));
    servers_.back()->start();
    return *servers_.back();
  }

  static StoreOptions fast_options() {
    StoreOptions o;
    o.connect_timeout = 500ms;
    o.request_timeout = 1000ms;
    o.attempts = 3;
    return o;
  }

  std::unique_ptr<BlobStore> open(const NginxStore& server, StoreOptions options = fast_options()) {
    return open_http_store(server.url(), options);
  }

  // Writes `bytes` into the served directory directly, as nginx would store a blob.
  static std::string put_on_disk(const NginxStore& server, std::string_view bytes) {
    std::string digest = sha256_digest(bytes);
    write_text(server.root() / "blobs" / "sha256" / digest.substr(7), std::string(bytes));
    return digest;
  }

  TempDir dir_;
  std::vector<std::unique_ptr<NginxStore>> servers_;
};

TEST_F(HttpStore, PutsAndReadsBlobs) {
  auto& server = serve();
  auto store = open(server);
  const std::string bytes = random_bytes(100000, 1);
  const std::string digest = sha256_digest(bytes);
  EXPECT_FALSE(store->has_blob(digest));
  store->put_blob(digest, bytes);
  EXPECT_TRUE(store->has_blob(digest));
  EXPECT_EQ(store->read_blob(digest), bytes);
  EXPECT_EQ(read_text(server.root() / "blobs" / "sha256" / digest.substr(7)), bytes);

  // Storing it again asks whether it is there and sends nothing.
  server.clear_requests();
  store->put_blob(digest, bytes);
  auto reqs = server.wait_for_requests(1);
  ASSERT_EQ(reqs.size(), 1u);
  EXPECT_EQ(reqs[0].method, "HEAD");

  // A file is streamed; an empty blob is a blob too.
  const std::string big = random_bytes(3u << 20, 2);
  write_text(dir_ / "layer.bin", big);
  const std::string big_digest = sha256_digest(big);
  store->put_blob_file(big_digest, dir_ / "layer.bin");
  EXPECT_EQ(sha256_file(server.root() / "blobs" / "sha256" / big_digest.substr(7)), big_digest);
  EXPECT_EQ(store->read_blob(big_digest), big);
  const std::string empty_digest = sha256_digest("");
  store->put_blob(empty_digest, "");
  EXPECT_TRUE(store->has_blob(empty_digest));
  EXPECT_EQ(store->read_blob(empty_digest), "");
  EXPECT_EQ(store->url(), server.url());
}

TEST_F(HttpStore, ChecksBytesAgainstTheirDigestBeforeSending) {
  auto& server = serve();
  auto store = open(server);
  const std::string other = sha256_digest("other bytes");
  EXPECT_CODE(store->put_blob(other, "these bytes"), Code::kDataLoss);
  write_text(dir_ / "f", "file bytes");
  EXPECT_CODE(store->put_blob_file(other, dir_ / "f"), Code::kDataLoss);
  EXPECT_CODE(store->put_blob("sha256:zz", "x"), Code::kInvalidArgument);
  EXPECT_CODE(store->put_blob_file(sha256_digest("x"), dir_ / "missing"), Code::kNotFound);
  EXPECT_CODE(store->read_blob("md5:abc"), Code::kInvalidArgument);
  EXPECT_TRUE(server.wait_for_requests(1, 200ms).empty()) << "nothing reaches the store";
  EXPECT_FALSE(fs::exists(server.root() / "blobs" / "sha256" / other.substr(7)));
}

TEST_F(HttpStore, ReadsRanges) {
  auto& server = serve();
  auto store = open(server);
  const std::string bytes = random_bytes(70000, 3);
  const std::string digest = sha256_digest(bytes);
  store->put_blob(digest, bytes);
  server.clear_requests();

  EXPECT_EQ(store->read_range(digest, 0, 1), bytes.substr(0, 1));
  EXPECT_EQ(store->read_range(digest, 1234, 5000), bytes.substr(1234, 5000));
  EXPECT_EQ(store->read_range(digest, bytes.size() - 1, 1), bytes.substr(bytes.size() - 1));
  EXPECT_EQ(store->read_range(digest, 0, bytes.size()), bytes);
  EXPECT_EQ(store->read_range(digest, bytes.size(), 0), "");
  auto reqs = server.wait_for_requests(4);
  ASSERT_GE(reqs.size(), 4u);
  EXPECT_EQ(reqs[0].range, "bytes=0-0");
  EXPECT_EQ(reqs[1].range, "bytes=1234-6233");
  EXPECT_EQ(reqs[2].range, "bytes=69999-69999");
  for (int i = 0; i < 4; ++i) EXPECT_EQ(reqs[i].status, 206) << i;

  EXPECT_CODE(store->read_range(digest, bytes.size(), 1), Code::kOutOfRange);
  EXPECT_CODE(store->read_range(digest, bytes.size() - 10, 11), Code::kOutOfRange);
  EXPECT_CODE(store->read_range(digest, bytes.size() + 1, 0), Code::kOutOfRange);
  EXPECT_CODE(store->read_range(digest, 1, ~0ull), Code::kOutOfRange);
  std::string msg = message_of([&] { store->read_range(digest, 100000, 10); });
  EXPECT_NE(msg.find(server.url() + "/blobs/sha256/" + digest.substr(7)), std::string::npos) << msg;
  EXPECT_NE(msg.find("70000 bytes"), std::string::npos) << msg;
}

TEST_F(HttpStore, MissingThingsAreNotFound) {
  auto& server = serve();
  auto store = open(server);
  const std::string digest = sha256_digest("never stored");
  EXPECT_FALSE(store->has_blob(digest));
  EXPECT_CODE(store->read_blob(digest), Code::kNotFound);
  EXPECT_CODE(store->read_range(digest, 0, 10), Code::kNotFound);
  EXPECT_CODE(store->read_range(digest, 0, 0), Code::kNotFound);
  std::string msg = message_of([&] { store->read_blob(digest); });
  EXPECT_NE(msg.find("GET " + server.url() + "/blobs/sha256/" + digest.substr(7) + ": HTTP 404"), std::string::npos)
      << msg;
  EXPECT_EQ(store->read_ref("nothing:here"), std::nullopt);
  EXPECT_FALSE(store->remove_ref("nothing:here"));
  store->remove_blob(digest);  // removing what is not there is a no-op
  EXPECT_TRUE(store->list_blobs().empty());
  EXPECT_TRUE(store->list_refs().empty());
}

TEST_F(HttpStore, CorruptBlobIsDataLoss) {
  auto& server = serve();
  auto store = open(server);
  const std::string bytes = random_bytes(5000, 4);
  const std::string digest = sha256_digest(bytes);
  store->put_blob(digest, bytes);
  std::string damaged = bytes;
  damaged[4000] ^= 1;
  write_text(server.root() / "blobs" / "sha256" / digest.substr(7), damaged);
  EXPECT_CODE(store->read_blob(digest), Code::kDataLoss);
  std::string msg = message_of([&] { store->read_blob(digest); });
  EXPECT_NE(msg.find(server.url() + "/blobs/sha256/" + digest.substr(7)), std::string::npos) << msg;
  EXPECT_NE(msg.find(sha256_digest(damaged)), std::string::npos) << msg;
  // Ranges are not verified here (chunk readers check each chunk): the damaged byte comes back as it is.
  EXPECT_EQ(store->read_range(digest, 3999, 2), damaged.substr(3999, 2));
}

TEST_F(HttpStore, WritesReadsListsAndRemovesRefs) {
  auto& server = serve();
  auto store = open(server);
  const std::string m1 = sha256_digest("manifest 1"), m2 = sha256_digest("manifest 2");
  store->write_ref("swe/task-17:latest", m1);
  store->write_ref("busybox", m2);  // the tag defaults to latest
  EXPECT_EQ(store->read_ref("swe/task-17:latest"), m1);
  EXPECT_EQ(store->read_ref("busybox:latest"), m2);
  EXPECT_EQ(read_text(server.root() / "refs" / "swe%2Ftask-17%3Alatest"), m1 + "\n");
  auto reqs = server.wait_for_requests(1);
  ASSERT_FALSE(reqs.empty());
  EXPECT_EQ(reqs[0].method, "PUT");
  EXPECT_EQ(reqs[0].uri, "/refs/swe%252Ftask-17%253Alatest");

  store->write_ref("swe/task-17:latest", m2);  // moving a tag
  EXPECT_EQ(store->read_ref("swe/task-17:latest"), m2);
  write_text(server.root() / "refs" / "stray file", "not a ref");
  EXPECT_EQ(store->list_refs(), (std::vector<std::string>{"busybox:latest", "swe/task-17:latest"}));

  EXPECT_TRUE(store->remove_ref("swe/task-17:latest"));
  EXPECT_FALSE(store->remove_ref("swe/task-17:latest"));
  EXPECT_EQ(store->read_ref("swe/task-17:latest"), std::nullopt);
  EXPECT_EQ(store->list_refs(), (std::vector<std::string>{"busybox:latest"}));

  write_text(server.root() / "refs" / "broken%3Alatest", "garbage\n");
  EXPECT_CODE(store->read_ref("broken:latest"), Code::kDataLoss);
  write_text(server.root() / "refs" / "huge%3Alatest", std::string(10000, 'x'));
  EXPECT_CODE(store->read_ref("huge:latest"), Code::kDataLoss);
  EXPECT_CODE(store->write_ref("a:b", "sha256:nope"), Code::kInvalidArgument);
  EXPECT_CODE(store->write_ref("Not A Name", m1), Code::kInvalidArgument);
  EXPECT_CODE(store->write_ref("a:b@" + m1, m1), Code::kInvalidArgument);
}

TEST_F(HttpStore, CreateRefNeverMovesATag) {
  auto& server = serve();
  auto store = open(server);
  const std::string m1 = sha256_digest("snapshot 1"), m2 = sha256_digest("snapshot 2");
  EXPECT_TRUE(store->create_ref("snap/x:1", m1));
  EXPECT_FALSE(store->create_ref("snap/x:1", m2));
  EXPECT_EQ(store->read_ref("snap/x:1"), m1);
  EXPECT_EQ(read_text(server.root() / "refs" / "snap%2Fx%3A1"), m1 + "\n");
  // The first: a look (404), then the PUT; the second: a look (200) and nothing written.
  auto reqs = server.wait_for_requests(4);
  ASSERT_GE(reqs.size(), 3u);
  EXPECT_EQ(reqs[0].method, "GET");
  EXPECT_EQ(reqs[0].status, 404);
  EXPECT_EQ(reqs[1].method, "PUT");
  EXPECT_EQ(reqs[2].method, "GET");
  EXPECT_EQ(reqs[2].status, 200);
  for (std::size_t i = 3; i < reqs.size(); ++i) EXPECT_NE(reqs[i].method, "PUT") << "the tag is not written again";
}

TEST_F(HttpStore, ListsAndRemovesBlobs) {
  auto& server = serve();
  auto store = open(server);
  std::vector<std::string> digests;
  for (int i = 0; i < 5; ++i) {
    std::string bytes = random_bytes(100 + i, 10 + i);
    digests.push_back(sha256_digest(bytes));
    store->put_blob(digests.back(), bytes);
  }
  write_text(server.root() / "blobs" / "sha256" / "not-a-digest", "x");
  fs::create_directories(server.root() / "blobs" / "sha256" / std::string(64, 'a'));  // a directory, not a blob
  std::sort(digests.begin(), digests.end());
  auto listed = store->list_blobs();
  ASSERT_EQ(listed.size(), 5u);
  const double now = static_cast<double>(::time(nullptr));
  for (std::size_t i = 0; i < listed.size(); ++i) {
    EXPECT_EQ(listed[i].digest, digests[i]);
    EXPECT_GE(listed[i].size, 100u);
    EXPECT_LE(listed[i].size, 104u);
    EXPECT_NEAR(listed[i].modified, now, 120.0);
  }
  store->remove_blob(digests[2]);
  EXPECT_FALSE(store->has_blob(digests[2]));
  EXPECT_FALSE(fs::exists(server.root() / "blobs" / "sha256" / digests[2].substr(7)));
  EXPECT_EQ(store->list_blobs().size(), 4u);
}

TEST_F(HttpStore, StoreThatDoesNotListIsUnimplemented) {
  auto& html = serve({.tls = false, .autoindex = "html", .location_extra = "", .server_extra = ""});
  auto& off = serve({.tls = false, .autoindex = "off", .location_extra = "", .server_extra = ""});
  for (NginxStore* server : {&html, &off}) {
    auto store = open(*server);
    store->write_ref("a:b", sha256_digest("m"));
    store->put_blob(sha256_digest("m"), "m");
    EXPECT_CODE(store->list_refs(), Code::kUnimplemented) << server->url();
    EXPECT_CODE(store->list_blobs(), Code::kUnimplemented) << server->url();
    std::string msg = message_of([&] { store->list_refs(); });
    EXPECT_NE(msg.find("does not list its contents"), std::string::npos) << msg;
    EXPECT_EQ(store->read_ref("a:b"), sha256_digest("m"));  // everything else works
  }
}

TEST_F(HttpStore, ServerThatIgnoresRangesIsRefused) {
  // nginx answers 200 with the whole file
  auto& server =
      serve({.tls = false, .autoindex = "json", .location_extra = "      max_ranges 0;", .server_extra = ""});
  auto store = open(server);
  const std::string bytes = random_bytes(50000, 5);
  const std::string digest = sha256_digest(bytes);
  store->put_blob(digest, bytes);
  EXPECT_CODE(store->read_range(digest, 100, 10), Code::kUnimplemented);
  EXPECT_CODE(store->read_range(digest, 0, 10), Code::kUnimplemented);
  EXPECT_CODE(store->read_range(digest, 0, bytes.size() + 1), Code::kOutOfRange);
  EXPECT_EQ(store->read_range(digest, 0, bytes.size()), bytes);  // the whole blob is the range asked for
}

TEST_F(HttpStore, ConcurrentRangeReadsShareKeptAliveConnections) {
  auto& server = serve();
  auto store = open(server);
  const std::string bytes = random_bytes(4u << 20, 6);
  const std::string digest = sha256_digest(bytes);
  store->put_blob(digest, bytes);
  server.clear_requests();

  constexpr int kThreads = 16, kReads = 40;
  std::atomic<int> wrong{0}, failed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937_64 rng(100 + t);
      for (int i = 0; i < kReads; ++i) {
        std::uint64_t len = 1 + rng() % 65536;
        std::uint64_t off = rng() % (bytes.size() - len + 1);
        try {
          if (store->read_range(digest, off, len) != bytes.substr(off, len)) ++wrong;
        } catch (const Error&) {
          ++failed;
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(wrong.load(), 0);
  EXPECT_EQ(failed.load(), 0);
  auto reqs = server.wait_for_requests(kThreads * kReads);
  ASSERT_EQ(reqs.size(), static_cast<std::size_t>(kThreads * kReads));
  std::set<std::uint64_t> connections;
  for (const auto& r : reqs) {
    EXPECT_EQ(r.status, 206);
    connections.insert(r.connection);
  }
  // Each thread holds one pooled handle at a time and the pool keeps 16: about one connection per thread.
  EXPECT_LE(connections.size(), static_cast<std::size_t>(kThreads + 4)) << "keep-alive connections are not reused";
}

TEST_F(HttpStore, StoreThatGoesAwayIsUnavailableWithinItsTimeouts) {
  auto& server = serve();
  auto store = open(server);
  const std::string bytes = random_bytes(10000, 7);
  const std::string digest = sha256_digest(bytes);
  store->put_blob(digest, bytes);
  ASSERT_EQ(store->read_range(digest, 0, 100), bytes.substr(0, 100));  // a kept-alive connection in the pool

  server.go_away();
  for (auto call : std::vector<std::function<void()>>{
           [&] { store->read_range(digest, 0, 100); }, [&] { store->read_blob(digest); },
           [&] { store->has_blob(digest); }, [&] { store->put_blob(sha256_digest("x"), "x"); },
           [&] { store->read_ref("a:b"); }, [&] { store->list_refs(); }}) {
    auto start = Clock::now();
    Error error(Code::kOk, "");
    try {
      call();
      ADD_FAILURE() << "a store that went away answered";
    } catch (const Error& e) {
      error = e;
    }
    auto took = Clock::now() - start;
    EXPECT_EQ(error.code(), Code::kUnavailable) << error.what();
    EXPECT_TRUE(error.retryable());
    EXPECT_NE(std::string(error.what()).find(server.url()), std::string::npos) << error.what();
    EXPECT_NE(std::string(error.what()).find("after 3 attempts"), std::string::npos) << error.what();
    EXPECT_LT(took, 3s);
  }

  server.start();  // back on the same port: the store recovers without being reopened
  EXPECT_EQ(store->read_range(digest, 5, 10), bytes.substr(5, 10));
}

TEST_F(HttpStore, ServerThatNeverAnswersIsUnavailableWithinTheTimeout) {
  StoreOptions options;
  options.connect_timeout = 500ms;
  options.request_timeout = 400ms;
  options.attempts = 2;
  const std::string digest = sha256_digest("x");
  for (auto mode : {StallingServer::kNeverAccept, StallingServer::kStallMidBody}) {
    StallingServer server(mode);
    auto store = open_http_store(server.url(), options);
    auto start = Clock::now();
    Code code = dsec::test::code_of([&] { store->read_range(digest, 0, 100000); });
    auto took = Clock::now() - start;
    EXPECT_EQ(code, Code::kUnavailable) << mode;
    EXPECT_GE(took, 800ms) << mode;  // two attempts of 400 ms each
    EXPECT_LT(took, 2500ms) << mode;
    if (mode == StallingServer::kStallMidBody) {
      EXPECT_EQ(server.accepted(), 2);
    }
  }
}

TEST_F(HttpStore, ServerErrorsAreRetriedThenUnavailable) {
  auto& server = serve({.tls = false,
                        .autoindex = "json",
                        .location_extra = "",
                        .server_extra = "    location /broken/ { return 503; }"});
  auto store = open_http_store(server.url() + "/broken/", fast_options());
  const std::string digest = sha256_digest("x");
  auto start = Clock::now();
  std::string msg = message_of([&] { store->read_blob(digest); });
  EXPECT_LT(Clock::now() - start, 2s);
  EXPECT_NE(msg.find("GET " + server.url() + "/broken/blobs/sha256/" + digest.substr(7) +
                     ": HTTP 503 (after 3 "
                     "attempts)"),
            std::string::npos)
      << msg;
  EXPECT_CODE(store->read_blob(digest), Code::kUnavailable);
  EXPECT_EQ(server.wait_for_requests(6).size(), 6u);  // three attempts each
}

TEST_F(HttpStore, BodyLargerThanMaxSizeIsResourceExhausted) {
  auto& server = serve();
  auto store = open(server);
  const std::string bytes = random_bytes(1u << 20, 8);
  const std::string digest = put_on_disk(server, bytes);
  EXPECT_CODE(store->read_blob(digest, 1000), Code::kResourceExhausted);
  EXPECT_CODE(store->read_blob(digest, bytes.size() - 1), Code::kResourceExhausted);
  EXPECT_EQ(store->read_blob(digest, bytes.size()), bytes);
}

TEST_F(HttpStore, HttpsVerifiesTheServerWithTheGivenCa) {
  auto& server = serve({.tls = true, .autoindex = "json", .location_extra = "", .server_extra = ""});
  StoreOptions options = fast_options();
  options.ca_file = server.ca_file();
  auto store = open_http_store(server.url(), options);
  const std::string digest = sha256_digest("over tls");
  store->put_blob(digest, "over tls");
  EXPECT_EQ(store->read_range(digest, 5, 3), "tls");
  store->write_ref("tls:latest", digest);
  EXPECT_EQ(store->list_refs(), std::vector<std::string>{"tls:latest"});

  auto untrusting = open_http_store(server.url(), fast_options());  // the system's CAs: not this self-signed one
  Error error(Code::kOk, "");
  try {
    untrusting->read_blob(digest);
  } catch (const Error& e) {
    error = e;
  }
  EXPECT_EQ(error.code(), Code::kUnavailable) << error.what();
  EXPECT_NE(std::string(error.what()).find("ca_file"), std::string::npos) << error.what();
}

TEST_F(HttpStore, OpenChecksTheUrlAndOptions) {
  EXPECT_CODE(open_http_store("ftp://127.0.0.1/x", {}), Code::kInvalidArgument);
  EXPECT_CODE(open_http_store("http://", {}), Code::kInvalidArgument);
  EXPECT_CODE(open_http_store("http://127.0.0.1/x?y=1", {}), Code::kInvalidArgument);
  StoreOptions bad;
  bad.attempts = 0;
  EXPECT_CODE(open_http_store("http://127.0.0.1/x", bad), Code::kInvalidArgument);
  StoreOptions missing_ca;
  missing_ca.ca_file = (dir_ / "no-such-ca.pem").string();
  EXPECT_CODE(open_http_store("https://127.0.0.1/x", missing_ca), Code::kInvalidArgument);
  EXPECT_EQ(open_store("http://127.0.0.1:1/dsec/")->url(), "http://127.0.0.1:1/dsec");
  auto with_password = open_store("http://user:secret@127.0.0.1:1/dsec");
  EXPECT_EQ(with_password->url().find("secret"), std::string::npos) << with_password->url();
}

}  // namespace
}  // namespace dsec::image
