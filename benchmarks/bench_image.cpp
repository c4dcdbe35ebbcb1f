// dsec-bench image: starting a sandbox from a large image on a cold node, lazily (EROFS over the agent's chunk
// fetcher: only what the task reads is fetched) against a full pull and extract (every chunk fetched, the layer's
// files extracted), in one run.
//
// The image is bench/task: Debian bookworm with python3 (base layer), a compiler toolchain installed on top of it
// (toolchain layer, holding only its difference from the base), and a small Python project with unittest tests
// (task layer). They are built with the dsec CLI into <home>/store when missing, and reused by tag afterwards.
//
// Every start is cold: a fresh embedded agent with an empty layer cache, and the store's blobs of the image dropped
// from the page cache first (posix_fadvise DONTNEED), so the store is read from disk as a remote store would be.
#include <fcntl.h>
#include <fmt/format.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "bench.hpp"
#include "common/syscall.hpp"
#include "common/unique_fd.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/chunk_index.hpp"
#include "image/store/digest.hpp"
#include "image/store/manifest.hpp"

extern char** environ;

namespace dsec::bench {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kBase = "bench/base";
constexpr std::string_view kToolchain = "bench/toolchain";
constexpr std::string_view kTask = "bench/task";
constexpr std::string_view kBasePackages = "python3";
// Enough of a toolchain for the image to pass 1 GiB: C, C++, Fortran, clang and LLVM's libraries, gdb, Python
// headers, numpy. libboost-regex1.74.0 is named because gdb needs it through a virtual package
// (libboost-regex1.74.0-icu72), which debootstrap's resolver does not follow.
constexpr std::string_view kToolchainPackages =
    "python3,build-essential,gdb,libboost-regex1.74.0,python3-dev,clang,llvm-dev,cmake,git,gfortran,"
    "python3-numpy";
constexpr std::uint64_t kGiB = 1ull << 30;

// The task each sandbox runs: the project's tests, imports across the standard library and numpy, and a C program
// compiled with gcc and run. The last line is the marker the benchmark checks.
constexpr std::string_view kTaskCommand =
    "cd /task && python3 -m unittest -q 2>&1 | tail -n 1 && "
    "python3 -c 'import json, decimal, fractions, statistics, sqlite3, csv, hashlib, zlib, ssl, asyncio, email.parser, "
    "xml.etree.ElementTree, http.client, argparse, numpy; print(\"imports ok\", numpy.__version__)' && "
    "gcc -O2 -o /tmp/fib native/fib.c && /tmp/fib 30 && echo TASK-DONE";

// The task layer's project: /task/calc (an expression calculator), /task/tests (unittest), /task/native/fib.c.
const std::vector<std::pair<std::string, std::string>>& task_files() {
  static const std::vector<std::pair<std::string, std::string>> files = {
      {"task/README.md", R"PY(# calc

A small expression calculator: tokenizer, recursive-descent parser, exact evaluator, and summary statistics.
Run the tests with `python3 -m unittest`.
)PY"},
      {"task/calc/__init__.py", R"PY("""calc: evaluate arithmetic expressions exactly."""
from .evaluator import evaluate
from .parser import parse
from .tokenizer import tokenize

__all__ = ["evaluate", "parse", "tokenize"]
)PY"},
      {"task/calc/tokenizer.py", R"PY("""Splits an expression into tokens."""
from dataclasses import dataclass
from fractions import Fraction

OPERATORS = "+-*/^()"


@dataclass(frozen=True)
class Token:
    kind: str  # "num", "op", "name"
    text: str
    value: Fraction | None = None


def tokenize(text: str) -> list[Token]:
    tokens: list[Token] = []
    i = 0
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c.isdigit() or c == ".":
            j = i
            while j < len(text) and (text[j].isdigit() or text[j] == "."):
                j += 1
            tokens.append(Token("num", text[i:j], Fraction(text[i:j])))
            i = j
        elif c.isalpha():
            j = i
            while j < len(text) and text[j].isalnum():
                j += 1
            tokens.append(Token("name", text[i:j]))
            i = j
        elif c in OPERATORS:
            tokens.append(Token("op", c))
            i += 1
        else:
            raise ValueError(f"unexpected character {c!r} at {i}")
    return tokens
)PY"},
      {"task/calc/parser.py",
       R"PY("""Recursive-descent parser: expr := term (('+'|'-') term)*, term := factor (('*'|'/') factor)*,
factor := unary ('^' factor)?, unary := '-' unary | atom, atom := num | name | name '(' expr ')' | '(' expr ')'."""
from .tokenizer import Token, tokenize


class Parser:
    def __init__(self, tokens: list[Token]):
        self.tokens = tokens
        self.pos = 0

    def peek(self):
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, text=None):
        tok = self.peek()
        if tok is None or (text is not None and tok.text != text):
            raise SyntaxError(f"expected {text or 'a token'} at token {self.pos}")
        self.pos += 1
        return tok

    def expr(self):
        node = self.term()
        while (tok := self.peek()) is not None and tok.text in "+-" and tok.kind == "op":
            self.take()
            node = (tok.text, node, self.term())
        return node

    def term(self):
        node = self.factor()
        while (tok := self.peek()) is not None and tok.text in "*/" and tok.kind == "op":
            self.take()
            node = (tok.text, node, self.factor())
        return node

    def factor(self):
        node = self.unary()
        if (tok := self.peek()) is not None and tok.text == "^":
            self.take()
            node = ("^", node, self.factor())
        return node

    def unary(self):
        if (tok := self.peek()) is not None and tok.text == "-":
            self.take()
            return ("neg", self.unary())
        return self.atom()

    def atom(self):
        tok = self.take()
        if tok.kind == "num":
            return ("num", tok.value)
        if tok.kind == "name":
            if (nxt := self.peek()) is not None and nxt.text == "(":
                self.take("(")
                arg = self.expr()
                self.take(")")
                return ("call", tok.text, arg)
            return ("var", tok.text)
        if tok.text == "(":
            node = self.expr()
            self.take(")")
            return node
        raise SyntaxError(f"unexpected {tok.text!r}")


def parse(text: str):
    p = Parser(tokenize(text))
    node = p.expr()
    if p.peek() is not None:
        raise SyntaxError(f"trailing input at token {p.pos}")
    return node
)PY"},
      {"task/calc/evaluator.py", R"PY("""Evaluates parsed expressions with exact fractions."""
import math
from fractions import Fraction

from .parser import parse

FUNCTIONS = {
    "abs": abs,
    "sqrt": lambda x: Fraction(math.isqrt(int(x))) if x.denominator == 1 and math.isqrt(int(x)) ** 2 == x
    else Fraction(math.sqrt(x)),
}


def _eval(node, env):
    op = node[0]
    if op == "num":
        return node[1]
    if op == "var":
        if node[1] not in env:
            raise NameError(node[1])
        return Fraction(env[node[1]])
    if op == "neg":
        return -_eval(node[1], env)
    if op == "call":
        return FUNCTIONS[node[1]](_eval(node[2], env))
    a, b = _eval(node[1], env), _eval(node[2], env)
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0:
            raise ZeroDivisionError("division by zero")
        return a / b
    if op == "^":
        if b.denominator != 1:
            raise ValueError("only integer powers")
        return a ** int(b)
    raise ValueError(op)


def evaluate(text: str, **env):
    return _eval(parse(text), env)
)PY"},
      {"task/calc/stats.py", R"PY("""Summary statistics of evaluated expressions."""
import statistics

from .evaluator import evaluate


def summarize(expressions, **env):
    values = [evaluate(e, **env) for e in expressions]
    return {
        "count": len(values),
        "sum": sum(values),
        "mean": statistics.mean(values),
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }
)PY"},
      {"task/tests/__init__.py", ""},
      {"task/tests/test_tokenizer.py", R"PY(import unittest
from fractions import Fraction

from calc.tokenizer import tokenize


class TokenizerTest(unittest.TestCase):
    def test_numbers_and_operators(self):
        toks = tokenize("12 + 3.5*(x - 1)")
        self.assertEqual([t.text for t in toks], ["12", "+", "3.5", "*", "(", "x", "-", "1", ")"])
        self.assertEqual(toks[2].value, Fraction(7, 2))

    def test_rejects_garbage(self):
        with self.assertRaises(ValueError):
            tokenize("1 $ 2")


if __name__ == "__main__":
    unittest.main()
)PY"},
      {"task/tests/test_parser.py", R"PY(import unittest
from fractions import Fraction

from calc.parser import parse


class ParserTest(unittest.TestCase):
    def test_precedence(self):
        self.assertEqual(parse("1+2*3"), ("+", ("num", 1), ("*", ("num", 2), ("num", 3))))

    def test_power_is_right_associative(self):
        self.assertEqual(parse("2^3^2"), ("^", ("num", 2), ("^", ("num", 3), ("num", 2))))

    def test_calls_and_unary_minus(self):
        self.assertEqual(parse("-abs(x)"), ("neg", ("call", "abs", ("var", "x"))))

    def test_errors(self):
        for bad in ["1+", "(1", "1 2", ")"]:
            with self.subTest(bad=bad), self.assertRaises(SyntaxError):
                parse(bad)


if __name__ == "__main__":
    unittest.main()
)PY"},
      {"task/tests/test_evaluator.py", R"PY(import unittest
from fractions import Fraction

from calc import evaluate
from calc.stats import summarize


class EvaluatorTest(unittest.TestCase):
    def test_exact_arithmetic(self):
        self.assertEqual(evaluate("1/3 + 1/6"), Fraction(1, 2))
        self.assertEqual(evaluate("2^10 - 24"), 1000)

    def test_variables(self):
        self.assertEqual(evaluate("x*x + y", x=3, y=1), 10)
        with self.assertRaises(NameError):
            evaluate("z")

    def test_functions(self):
        self.assertEqual(evaluate("sqrt(144) + abs(-2)"), 14)

    def test_division_by_zero(self):
        with self.assertRaises(ZeroDivisionError):
            evaluate("1/(2-2)")

    def test_summary(self):
        s = summarize(["1", "2", "3", "x"], x=10)
        self.assertEqual(s["count"], 4)
        self.assertEqual(s["sum"], 16)
        self.assertEqual(s["median"], Fraction(5, 2))
        self.assertEqual(s["max"], 10)


if __name__ == "__main__":
    unittest.main()
)PY"},
      {"task/native/fib.c", R"PY(#include <stdio.h>
#include <stdlib.h>

static unsigned long fib(unsigned n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }

int main(int argc, char** argv) {
  unsigned n = argc > 1 ? (unsigned)strtoul(argv[1], NULL, 10) : 20;
  printf("fib(%u) = %lu\n", n, fib(n));
  return 0;
}
)PY"},
  };
  return files;
}

std::string human(double bytes) {
  if (bytes >= kGiB) return fmt::format("{:.2f} GiB", bytes / kGiB);
  if (bytes >= (1 << 20)) return fmt::format("{:.1f} MiB", bytes / (1 << 20));
  return fmt::format("{:.0f} KiB", bytes / 1024);
}

std::string pct(double part, double whole) { return whole > 0 ? fmt::format("{:.1f}%", 100.0 * part / whole) : "n/a"; }

std::string default_cli() {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path beside = self.parent_path() / "dsec";
    if (::access(beside.c_str(), X_OK) == 0) return beside.string();
  }
  return "dsec";
}

bool has_image(image::BlobStore& store, std::string_view name) {
  try {
    image::fetch_manifest(store, image::parse_reference(name));
    return true;
  } catch (const Error& e) {
    if (e.code() == Code::kNotFound) return false;
    throw;
  }
}

// Builds bench/base, bench/toolchain and bench/task in <home>/store, each only when its tag is missing.
void prepare_images(const Options& o, const std::string& home, image::BlobStore& store, const fs::path& work,
                    std::vector<std::string>& notes) {
  const std::string cli = o.dsec_cli.empty() ? default_cli() : o.dsec_cli;
  auto build = [&](std::vector<std::string> args) {
    std::vector<std::string> argv{cli, "--home", home, "image", "build"};
    argv.insert(argv.end(), args.begin(), args.end());
    std::string line;
    for (const auto& a : argv) line += (line.empty() ? "" : " ") + a;
    fmt::print(stderr, "dsec-bench: {}\n", line);
    notes.push_back(fmt::format("built: `{}`", line));
    run_command(argv);
  };
  if (!has_image(store, kBase))
    build({std::string(kBase), "--from", "debootstrap:bookworm", "--include", std::string(kBasePackages), "-q"});
  if (!has_image(store, kToolchain))
    build({std::string(kToolchain), "--parent", std::string(kBase), "--role", "toolchain", "--from",
           "debootstrap:bookworm", "--include", std::string(kToolchainPackages), "-q"});
  if (!has_image(store, kTask)) {
    fs::path src = work / "task-layer";
    for (const auto& [rel, text] : task_files()) {
      fs::path p = src / rel;
      fs::create_directories(p.parent_path());
      std::ofstream out(p, std::ios::binary | std::ios::trunc);
      out << text;
      if (!out) throw Error(Code::kInternal, fmt::format("cannot write {}", p.string()));
    }
    build({std::string(kTask), "--parent", std::string(kToolchain), "--role", "task", "--from", "dir:" + src.string(),
           "-q"});
  }
}

// Drops the image's blobs in a directory store from the page cache, so a start reads the store from disk. Flushes
// what earlier runs left dirty first, so that their writeback does not land in this run's timing.
void evict_from_page_cache(const fs::path& store_root, const image::ResolvedManifest& image) {
  ::sync();
  for (const auto& digest : image::blobs_of(image)) {
    fs::path p = store_root / "blobs" / "sha256" / image::digest_hex(digest);
    UniqueFd fd(::open(p.c_str(), O_RDONLY | O_CLOEXEC));
    if (!fd) continue;
    ::fdatasync(fd.get());
    ::posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
  }
}

// Bytes a process (with the children it reaped) caused to be written to storage: write_bytes of /proc/<pid>/io
// less cancelled_write_bytes (dirty pages of files deleted or truncated before they reached the disk).
std::int64_t process_written_bytes(int pid) {
  std::istringstream in(read_text_file(fmt::format("/proc/{}/io", pid)));
  std::string key;
  std::int64_t value = 0, written = 0, cancelled = 0;
  while (in >> key >> value) {
    if (key == "write_bytes:") written = value;
    if (key == "cancelled_write_bytes:") cancelled = value;
  }
  return written - cancelled;
}

// The agent's --layer-cache directory, from its command line.
fs::path agent_layer_cache(int pid) {
  std::string cmdline = read_text_file(fmt::format("/proc/{}/cmdline", pid));
  std::vector<std::string> args;
  for (std::size_t at = 0; at < cmdline.size();) {
    std::size_t end = cmdline.find('\0', at);
    if (end == std::string::npos) end = cmdline.size();
    args.push_back(cmdline.substr(at, end - at));
    at = end + 1;
  }
  for (std::size_t i = 0; i + 1 < args.size(); ++i)
    if (args[i] == "--layer-cache") return args[i + 1];
  return {};
}

// The block device holding `path`: its /sys/dev/block/M:m directory (a partition or a whole disk), or empty.
fs::path block_device_of(const fs::path& path) {
  struct stat st {};
  if (path.empty() || ::stat(path.c_str(), &st) != 0) return {};
  fs::path dir = fmt::format("/sys/dev/block/{}:{}", major(st.st_dev), minor(st.st_dev));
  return fs::exists(dir / "stat") ? dir : fs::path();
}

// Sectors written (the 7th field of the block device's stat) in bytes.
std::uint64_t device_written_bytes(const fs::path& dev) {
  if (dev.empty()) return 0;
  std::istringstream in(read_text_file((dev / "stat").string()));
  std::uint64_t f[7] = {};
  for (auto& v : f) in >> v;
  return f[6] * 512;
}

std::uint64_t cached_bytes(Client& client) {
  std::uint64_t total = 0;
  for (const auto& node : client.nodes())
    for (const auto& layer : node.cached_layers) total += layer.cached_bytes;
  return total;
}

SandboxSpec task_spec() {
  SandboxSpec spec;
  spec.image = std::string(kTask);
  spec.kind = "container";
  spec.resources.cpu = 1.0;
  spec.resources.memory_bytes = 1ull << 30;
  spec.ttl = std::chrono::seconds(1800);
  spec.labels = {{"dsec-bench", "image"}};
  return spec;
}

ExecRequest task_request() {
  ExecRequest r;
  r.shell = std::string(kTaskCommand);
  r.timeout_seconds = 600;
  return r;
}

void check_task(const ExecResult& r, std::string_view what) {
  if (r.exit_code != 0 || r.timed_out || r.stdout_data.find("TASK-DONE") == std::string::npos ||
      r.stdout_data.find("fib(30) = 832040") == std::string::npos)
    throw Error(Code::kInternal,
                fmt::format("{}: the task ended with exit code {} (signal {}){}\nstdout: {}\nstderr: {}", what,
                            r.exit_code, r.signal, r.timed_out ? ", timed out" : "", r.stdout_data.substr(0, 2000),
                            r.stderr_data.substr(0, 2000)));
}

// A cold node: a fresh embedded agent (empty private layer cache) in `mode`.
ClientOptions cold_node(const Options& o, const std::string& home, const std::string& mode, std::size_t sandboxes) {
  ClientOptions c;
  c.home = home;
  c.agent_binary = o.agent_binary;
  c.stores = {home + "/store"};
  c.agent_args = {"--backends",         "container",
                  "--layer-mode",       mode,
                  "--layer-cache-size", "64Gi",
                  "--netns-pool",       fmt::format("{}", std::max<std::size_t>(4, sandboxes)),
                  "--cpu-overcommit",   fmt::format("{}", std::max<std::size_t>(32, sandboxes))};
  c.agent_start_timeout = std::chrono::seconds(60);
  c.agent_stop_grace = std::chrono::seconds(60);
  return c;
}

// A fresh agent fills its pool of network namespaces in the background; let it finish before timing.
void settle() { std::this_thread::sleep_for(std::chrono::milliseconds(500)); }

void expect_mode(const std::string& mode, const std::string& reported) {
  bool ok = mode == "lazy" ? reported == "erofs-lazy" : reported.rfind("extract", 0) == 0;
  if (!ok)
    throw Error(Code::kFailedPrecondition,
                fmt::format("the agent was started with --layer-mode {} but reports layer mode '{}'", mode, reported));
}

ColdStart one_cold_start(const Options& o, const std::string& home, const std::string& mode,
                         const image::ResolvedManifest& image, std::string& node_mode) {
  evict_from_page_cache(fs::path(home) / "store", image);
  Client client(cold_node(o, home, mode, 1));
  node_mode = client.nodes().front().layer_mode;
  expect_mode(mode, node_mode);
  settle();
  const std::string endpoint = client.endpoint();
  std::string before = agent_get(endpoint, "/metrics");
  ColdStart c;
  auto t0 = Clock::now();
  Sandbox sb = client.create(task_spec());
  c.create_ms = ms_since(t0);
  auto t1 = Clock::now();
  ExecResult first = sb.exec(task_request());
  c.first_exec_ms = ms_since(t1);
  c.total_ms = ms_since(t0);
  check_task(first, fmt::format("cold start ({})", mode));
  auto t2 = Clock::now();
  check_task(sb.exec(task_request()), fmt::format("second run ({})", mode));
  c.warm_exec_ms = ms_since(t2);
  std::string after = agent_get(endpoint, "/metrics");
  c.fetched_bytes = metric(after, "dsec_layer_fetched_bytes_total") - metric(before, "dsec_layer_fetched_bytes_total");
  c.fetched_chunks = metric(after, "dsec_layer_chunk_fetches_total") - metric(before, "dsec_layer_chunk_fetches_total");
  c.cached_bytes = cached_bytes(client);
  sb.destroy();
  client.close();
  return c;
}

ConcurrentStarts concurrent_cold_starts(const Options& o, const std::string& home, const std::string& mode,
                                        const image::ResolvedManifest& image, fs::path& device) {
  evict_from_page_cache(fs::path(home) / "store", image);
  Client client(cold_node(o, home, mode, o.starts));
  expect_mode(mode, client.nodes().front().layer_mode);
  settle();
  const int agent = agent_pid_for(client);
  if (agent <= 0) throw Error(Code::kInternal, "cannot find the embedded agent's process");
  device = block_device_of(agent_layer_cache(agent));
  const std::string endpoint = client.endpoint();
  std::string before = agent_get(endpoint, "/metrics");
  ::sync();
  const std::int64_t io0 = process_written_bytes(agent);
  const std::uint64_t dev0 = device_written_bytes(device);

  ConcurrentStarts r;
  r.count = o.starts;
  std::vector<std::optional<Sandbox>> sandboxes(o.starts);
  std::vector<double> ms(o.starts, 0);
  std::mutex error_mutex;
  std::string error;
  std::vector<std::thread> threads;
  auto t0 = Clock::now();
  for (std::size_t i = 0; i < o.starts; ++i) {
    threads.emplace_back([&, i] {
      try {
        auto t = Clock::now();
        sandboxes[i].emplace(client.create(task_spec()));
        check_task(sandboxes[i]->exec(task_request()), fmt::format("concurrent start {} ({})", i, mode));
        ms[i] = ms_since(t);
      } catch (const std::exception& e) {
        std::lock_guard lock(error_mutex);
        if (error.empty()) error = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  r.wall_ms = ms_since(t0);
  std::string after = agent_get(endpoint, "/metrics");
  r.fetched_bytes = metric(after, "dsec_layer_fetched_bytes_total") - metric(before, "dsec_layer_fetched_bytes_total");
  r.cached_bytes = cached_bytes(client);
  threads.clear();
  for (auto& sb : sandboxes)
    if (sb)
      threads.emplace_back([&sb] {
        try {
          sb->destroy();
        } catch (...) {
        }
      });
  for (auto& t : threads) t.join();
  if (!error.empty()) throw Error(Code::kInternal, error);
  for (double v : ms) r.per_start.add(v);
  // Written back and counted: the agent's own writes (chunks, extracted files; its reaped children's, such as
  // fsck.erofs, included), and the device's sectors (everything on the machine, other users included).
  ::sync();
  r.agent_write_bytes = static_cast<std::uint64_t>(std::max<std::int64_t>(0, process_written_bytes(agent) - io0));
  r.device_write_bytes = device_written_bytes(device) - dev0;
  client.close();
  return r;
}

}  // namespace

ImageBenchResult run_image(const Options& o, const std::string& home) {
  ImageBenchResult result;
  auto store = image::open_directory_store(fs::path(home) / "store");
  result.store = (fs::path(home) / "store").string();
  std::string templ = (fs::temp_directory_path() / "dsec-bench-image-XXXXXX").string();
  if (::mkdtemp(templ.data()) == nullptr) throw_errno(errno, "mkdtemp");
  struct RemoveDir {
    fs::path p;
    ~RemoveDir() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } remove_work{templ};
  prepare_images(o, home, *store, templ, result.notes);

  image::ResolvedManifest image = image::fetch_manifest(*store, image::parse_reference(kTask));
  result.image = image.reference.to_string();
  result.image_bytes = image.manifest.size();
  result.stored_bytes = image.manifest.stored_size();
  for (const auto& layer : image.manifest.layers) {
    ImageLayerInfo info;
    info.role = std::string(image::to_string(layer.role));
    info.digest = layer.digest;
    info.size = layer.size;
    info.stored_size = layer.stored_size;
    info.files_size = layer.files_size;
    image::ChunkIndex index = image::chunk_index_from_json(store->read_blob(layer.index));
    info.chunks = index.chunk_count();
    info.prefetch_chunks = index.prefetch.size();
    result.chunk_size = index.chunk_size;
    result.layers.push_back(info);
  }
  if (result.image_bytes < kGiB)
    result.notes.push_back(fmt::format("the image is {} (under 1 GiB): add packages to the toolchain layer",
                                       human(static_cast<double>(result.image_bytes))));
  result.task = std::string(kTaskCommand);
  result.cores = static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN));

  for (const auto& mode : o.layer_modes) {
    LayerModeResult m;
    m.mode = mode;
    CpuMeter cpu({});
    for (std::size_t i = 0; i < o.cold_runs; ++i) {
      fmt::print(stderr, "  image: cold start {}/{} ({})\n", i + 1, o.cold_runs, mode);
      m.cold.push_back(one_cold_start(o, home, mode, image, m.node_mode));
    }
    if (o.starts > 0) {
      fmt::print(stderr, "  image: {} concurrent cold starts ({})\n", o.starts, mode);
      fs::path device;
      m.concurrent = concurrent_cold_starts(o, home, mode, image, device);
      if (!device.empty()) result.block_device = fs::canonical(device).filename().string();
    }
    m.cpu = cpu.stop();
    result.modes.push_back(std::move(m));
  }
  return result;
}

namespace {

double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

template <typename F>
double median_cold(const LayerModeResult& m, F field) {
  std::vector<double> v;
  for (const auto& c : m.cold) v.push_back(static_cast<double>(field(c)));
  return median_of(v);
}

std::uint64_t total_chunks(const ImageBenchResult& r) {
  std::uint64_t n = 0;
  for (const auto& l : r.layers) n += l.chunks;
  return n;
}

std::string secs(double ms) { return fmt::format("{:.2f} s", ms / 1000); }

const LayerModeResult* find_mode(const ImageBenchResult& r, std::string_view mode) {
  for (const auto& m : r.modes)
    if (m.mode == mode) return &m;
  return nullptr;
}

}  // namespace

void print_image(const ImageBenchResult& r) {
  fmt::print("\n== image: cold starts of {} ==\n", r.image);
  fmt::print("  image: {} in {} layers ({} stored as zstd chunks of {})\n", human(static_cast<double>(r.image_bytes)),
             r.layers.size(), human(static_cast<double>(r.stored_bytes)), human(r.chunk_size));
  for (const auto& l : r.layers)
    fmt::print("    {:<10} {:>10} EROFS, {:>10} stored, {:>10} of files, {:>5} chunks ({} of metadata)  {}\n", l.role,
               human(static_cast<double>(l.size)), human(static_cast<double>(l.stored_size)),
               human(static_cast<double>(l.files_size)), l.chunks, l.prefetch_chunks, l.digest.substr(0, 19));
  fmt::print("  task: {}\n", r.task);
  fmt::print("\n  {:<9} {:>7} {:>10} {:>12} {:>14} {:>12} {:>14} {:>12} {:>12}\n", "mode", "run", "create",
             "first exec", "create->result", "warm exec", "fetched", "of stored", "chunks");
  for (const auto& m : r.modes) {
    for (std::size_t i = 0; i < m.cold.size(); ++i) {
      const auto& c = m.cold[i];
      fmt::print("  {:<9} {:>7} {:>10} {:>12} {:>14} {:>12} {:>14} {:>12} {:>12}\n", m.mode, i + 1, secs(c.create_ms),
                 secs(c.first_exec_ms), secs(c.total_ms), secs(c.warm_exec_ms),
                 human(static_cast<double>(c.fetched_bytes)),
                 pct(static_cast<double>(c.fetched_bytes), static_cast<double>(r.stored_bytes)),
                 fmt::format("{} ({})", c.fetched_chunks,
                             pct(static_cast<double>(c.fetched_chunks), static_cast<double>(total_chunks(r)))));
    }
  }
  fmt::print("\n  {:<9} {:>8} {:>12} {:>12} {:>12} {:>16} {:>16} {:>12}\n", "mode", "starts", "wall", "start p50",
             "start max", "agent wrote", "device wrote", "fetched");
  for (const auto& m : r.modes) {
    const auto& c = m.concurrent;
    if (c.count == 0) continue;
    fmt::print("  {:<9} {:>8} {:>12} {:>12} {:>12} {:>16} {:>16} {:>12}\n", m.mode, c.count, secs(c.wall_ms),
               secs(c.per_start.percentile(50)), secs(c.per_start.max()),
               human(static_cast<double>(c.agent_write_bytes)), human(static_cast<double>(c.device_write_bytes)),
               human(static_cast<double>(c.fetched_bytes)));
  }
  fmt::print(
      "  (agent wrote: /proc/<dsecd>/io write_bytes less cancelled_write_bytes, with its reaped children; "
      "device wrote: sectors written "
      "to {} by everything on the machine; both after sync)\n",
      r.block_device.empty() ? "the cache's device" : r.block_device);
  for (const auto& m : r.modes) print_cpu(m.cpu, r.cores, fmt::format("  load while {} ran: ", m.mode));
  for (const auto& n : r.notes) fmt::print("  note: {}\n", n);
}

std::string markdown_image(const ImageBenchResult& r) {
  std::string md;
  md += fmt::format("### Image start on a cold node: lazy against full pull and extract\n\n");
  md += fmt::format("Image `{}`: {} of EROFS layers, {} stored as zstd chunks of {}:\n\n", r.image,
                    human(static_cast<double>(r.image_bytes)), human(static_cast<double>(r.stored_bytes)),
                    human(r.chunk_size));
  md +=
      "| layer | EROFS | stored | files | chunks | of them metadata (prefetched) |\n"
      "| --- | --- | --- | --- | --- | --- |\n";
  for (const auto& l : r.layers)
    md += fmt::format("| {} | {} | {} | {} | {} | {} |\n", l.role, human(static_cast<double>(l.size)),
                      human(static_cast<double>(l.stored_size)), human(static_cast<double>(l.files_size)), l.chunks,
                      l.prefetch_chunks);
  md += fmt::format("\nTask, the first exec in each sandbox: `{}`\n\n", r.task);
  md +=
      "| layer mode | create | first exec | create to first result | same exec again | fetched from the store "
      "(of stored bytes) | chunks fetched (of the image's) |\n| --- | --- | --- | --- | --- | --- | --- |\n";
  for (const auto& m : r.modes) {
    if (m.cold.empty()) continue;
    double fetched = median_cold(m, [](const ColdStart& c) { return c.fetched_bytes; });
    double chunks = median_cold(m, [](const ColdStart& c) { return c.fetched_chunks; });
    md += fmt::format("| {} (`{}`), median of {} | {} | {} | **{}** | {} | {} ({}) | {} ({}) |\n", m.mode, m.node_mode,
                      m.cold.size(), secs(median_cold(m, [](const ColdStart& c) { return c.create_ms; })),
                      secs(median_cold(m, [](const ColdStart& c) { return c.first_exec_ms; })),
                      secs(median_cold(m, [](const ColdStart& c) { return c.total_ms; })),
                      secs(median_cold(m, [](const ColdStart& c) { return c.warm_exec_ms; })), human(fetched),
                      pct(fetched, static_cast<double>(r.stored_bytes)), static_cast<std::uint64_t>(chunks),
                      pct(chunks, static_cast<double>(total_chunks(r))));
  }
  bool any_concurrent = false;
  for (const auto& m : r.modes) any_concurrent |= m.concurrent.count > 0;
  if (any_concurrent) {
    md += fmt::format(
        "\nConcurrent cold starts (each a create and the task's exec, all at once on a fresh agent):\n\n"
        "| layer mode | starts | wall time | per start p50 | per start max | written by the agent | written to {} "
        "| fetched |\n| --- | --- | --- | --- | --- | --- | --- | --- |\n",
        r.block_device.empty() ? "the disk" : "`" + r.block_device + "`");
    for (const auto& m : r.modes) {
      const auto& c = m.concurrent;
      if (c.count == 0) continue;
      md += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} |\n", m.mode, c.count, secs(c.wall_ms),
                        secs(c.per_start.percentile(50)), secs(c.per_start.max()),
                        human(static_cast<double>(c.agent_write_bytes)),
                        human(static_cast<double>(c.device_write_bytes)), human(static_cast<double>(c.fetched_bytes)));
    }
    md +=
        "\n\"Written by the agent\" is `write_bytes` less `cancelled_write_bytes` of `/proc/<dsecd>/io` "
        "(children it reaped, such as "
        "`fsck.erofs`, included), \"written to\" the device's sectors-written counter (everything on the machine); "
        "both read after `sync`.\n";
  }
  md += "\n";
  for (const auto& m : r.modes)
    md += fmt::format(
        "Load while {} ran: {:.0f} s; CPU busy {:.2f} of {} cores: dsec-bench, its agents and their "
        "sandboxes {:.2f}, kernel threads and interrupts {:.2f}, other processes {:.2f}.\n",
        m.mode, m.cpu.seconds, m.cpu.busy_cores, r.cores, m.cpu.ours_cores, m.cpu.kernel_cores, m.cpu.others_cores);
  const LayerModeResult* lazy = find_mode(r, "lazy");
  if (lazy && !lazy->cold.empty()) {
    double fetched = median_cold(*lazy, [](const ColdStart& c) { return c.fetched_bytes; });
    double total = median_cold(*lazy, [](const ColdStart& c) { return c.total_ms; });
    md += fmt::format(
        "\nTargets: fetched <= 15% of the image: {} ({}); first exec result from a cold 1 GiB image "
        "<= 2 s: {} ({}).\n",
        fetched <= 0.15 * static_cast<double>(r.stored_bytes) ? "**met**" : "**not met**",
        pct(fetched, static_cast<double>(r.stored_bytes)), total <= 2000 ? "**met**" : "**not met**", secs(total));
  }
  for (const auto& n : r.notes) md += fmt::format("\n- {}", n);
  md += "\n";
  return md;
}

}  // namespace dsec::bench
