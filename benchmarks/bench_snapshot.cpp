// dsec-bench snapshot: how long a snapshot stops a sandbox and takes in all, against the size of what the sandbox
// wrote (files of random bytes, the worst case for compression), and a fork: the time from Sandbox::fork(N) to all
// N sandboxes answering an exec. The snapshots go to a store of their own under the work directory (the embedded
// agent's --snapshot-store), which is emptied after each size and removed at the end, so the run's disk use stays
// near the largest size times three.
#include <fmt/format.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <thread>

#include "bench.hpp"
#include "dsec/error.hpp"
#include "dsec/sandbox.hpp"
#include "host.hpp"
#include "image/store/blob_store.hpp"
#include "image/store/catalog.hpp"
#include "image/store/manifest.hpp"

namespace dsec::bench {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;

void check_ok(const ExecResult& r, const std::string& what) {
  if (r.exit_code != 0 || r.timed_out)
    throw Error(Code::kInternal, fmt::format("{}: exit code {} (signal {}, timed out {}): {}", what, r.exit_code,
                                             r.signal, r.timed_out, r.stderr_data.substr(0, 500)));
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Removes what the benchmark tagged in its private snapshot store, and the blobs only those tags needed.
void empty_store(const std::string& url, const std::vector<std::string>& tags) {
  if (url.empty()) return;
  auto store = image::open_store(url);
  for (const auto& tag : tags) store->remove_ref(tag);
  image::collect_garbage(*store, std::chrono::seconds(0));
}

std::string load_text(const CpuUse& c, int cores) {
  return fmt::format(
      "{:.1f} s; CPU busy {:.2f} of {} cores (dsec-bench, its agent and sandboxes {:.2f}, kernel "
      "threads {:.2f}, other processes {:.2f})",
      c.seconds, c.busy_cores, cores, c.ours_cores, c.kernel_cores, c.others_cores);
}

}  // namespace

SnapshotBenchResult run_snapshot(const Options& options, Client& client, const std::string& snapshot_store) {
  SnapshotBenchResult result;
  result.store = snapshot_store.empty() ? "the agent's snapshot store" : snapshot_store;
  CpuMeter cpu({agent_pid_for(client)});
  int serial = 0;
  const std::string run_tag = fmt::format("{:x}", static_cast<unsigned>(::getpid()));

  for (std::size_t mib : options.snapshot_sizes) {
    SnapshotSizePoint point;
    point.mib = mib;
    std::vector<std::string> tags;
    SandboxSpec spec = bench_spec(options);
    // The writable layer is a tmpfs charged to the sandbox's memory: room for the files, and for the shell.
    spec.resources.disk_bytes = (static_cast<std::uint64_t>(mib) + 64) << 20;
    spec.resources.memory_bytes = (static_cast<std::uint64_t>(mib) + 128) << 20;
    Sandbox sb = client.create(spec);
    // N files of 1 MiB of random bytes, under /data.
    ExecRequest write;
    write.shell = fmt::format(
        "mkdir -p /data && i=0; while [ $i -lt {} ]; do head -c 1048576 /dev/urandom > "
        "/data/f$i || exit 1; i=$((i+1)); done",
        mib);
    write.timeout_seconds = 300;
    check_ok(sb.exec(write), fmt::format("writing {} MiB in sandbox {}", mib, sb.id()));
    const std::size_t runs = mib >= 256 ? std::min<std::size_t>(options.snapshot_repeat, 2) : options.snapshot_repeat;
    for (std::size_t i = 0; i < runs; ++i) {
      std::string name = fmt::format("dsec-bench/snapshot:{}-{}mib-{}", run_tag, mib, serial++);
      auto t0 = Clock::now();
      SnapshotResult snap = sb.snapshot(name);
      point.client_ms.push_back(ms_since(t0));
      point.frozen_ms.push_back(snap.frozen_seconds * 1000);
      point.agent_ms.push_back(snap.seconds * 1000);
      point.stored_bytes = snap.stored_bytes;
      point.file_bytes = snap.file_bytes;
      tags.push_back(name);
      // Each run stores a layer of its own (mkfs.erofs stamps a fresh UUID) into an emptied store, and copies the
      // image's layers there again, as a first snapshot into a new store does.
      empty_store(snapshot_store, {name});
      tags.pop_back();
    }
    // A sandbox from the last size's snapshot: time to its first exec (layers streamed on demand).
    if (mib == options.snapshot_sizes.back()) {
      std::string name = fmt::format("dsec-bench/snapshot:{}-{}mib-start", run_tag, mib);
      SnapshotResult snap = sb.snapshot(name);
      tags.push_back(name);
      SandboxSpec from = spec;
      from.image = snap.image;
      auto t0 = Clock::now();
      Sandbox copy = client.create(from);
      ExecRequest read;
      read.shell = "cat /data/f0 | wc -c";
      read.timeout_seconds = 60;
      ExecResult r = copy.exec(read);
      result.start_from_snapshot_ms = ms_since(t0);
      result.start_mib = mib;
      check_ok(r, "reading a file of the snapshot");
      copy.destroy();
    }
    sb.destroy();
    empty_store(snapshot_store, tags);
    fmt::print(stderr, "dsec-bench: snapshot of {} MiB: frozen {:.1f} ms, {:.1f} ms in all (median of {})\n", mib,
               median(point.frozen_ms), median(point.agent_ms), point.agent_ms.size());
    result.sizes.push_back(std::move(point));
  }

  // Fork: a sandbox with a little state, then fork(N) and an exec in each of the N.
  if (options.fork_count > 0) {
    SandboxSpec spec = bench_spec(options);
    spec.resources.memory_bytes = 64ull << 20;
    spec.resources.cpu = 0.1;
    Sandbox sb = client.create(spec);
    ExecRequest prepare;
    prepare.shell = "mkdir -p /state && head -c 1048576 /dev/urandom > /state/blob && echo 7 > /state/step";
    prepare.timeout_seconds = 60;
    check_ok(sb.exec(prepare), "preparing the sandbox to fork");
    std::vector<std::string> tags;
    for (std::size_t round = 0; round < options.snapshot_repeat; ++round) {
      std::string name = fmt::format("dsec-bench/fork:{}-{}", run_tag, round);
      auto t0 = Clock::now();
      std::vector<Sandbox> forks = sb.fork(options.fork_count, name);
      double forked = ms_since(t0);
      std::atomic<std::size_t> next{0};
      std::atomic<bool> failed{false};
      std::string failure;
      std::mutex failure_mu;
      auto work = [&] {
        for (std::size_t i = next.fetch_add(1); i < forks.size(); i = next.fetch_add(1)) {
          ExecRequest r;
          r.shell = "cat /state/step";
          r.timeout_seconds = 60;
          try {
            ExecResult out = forks[i].exec(r);
            check_ok(out, "exec in a fork");
            if (out.stdout_data != "7\n") throw Error(Code::kInternal, "a fork does not see the forked files");
          } catch (const std::exception& e) {
            std::lock_guard lock(failure_mu);
            failed = true;
            failure = e.what();
          }
        }
      };
      std::vector<std::thread> threads;
      for (std::size_t w = 1; w < std::min<std::size_t>(forks.size(), 16); ++w) threads.emplace_back(work);
      work();
      for (auto& t : threads) t.join();
      if (failed) throw Error(Code::kInternal, failure);
      result.fork_total_ms.push_back(ms_since(t0));
      result.fork_call_ms.push_back(forked);
      for (auto& f : forks) f.destroy();
      tags.push_back(name);
      empty_store(snapshot_store, tags);
      tags.clear();
    }
    result.forks = options.fork_count;
    sb.destroy();
  }
  result.cpu = cpu.stop();
  return result;
}

void print_snapshot(const SnapshotBenchResult& r) {
  fmt::print("\n== snapshot: a sandbox that wrote N MiB of random files (snapshots into {}) ==\n", r.store);
  fmt::print("  {:>8} {:>6} {:>12} {:>12} {:>12} {:>12} {:>10}\n", "written", "runs", "frozen", "agent total", "client",
             "stored", "MiB/s");
  for (const auto& p : r.sizes) {
    double total = median(p.agent_ms);
    fmt::print("  {:>5} MiB {:>6} {:>9.1f} ms {:>9.1f} ms {:>9.1f} ms {:>8.1f} MiB {:>10.0f}\n", p.mib,
               p.agent_ms.size(), median(p.frozen_ms), total, median(p.client_ms), p.stored_bytes / kMiB,
               total > 0 ? static_cast<double>(p.mib) / (total / 1000) : 0.0);
  }
  if (r.start_from_snapshot_ms > 0)
    fmt::print("  create from the {} MiB snapshot to its first exec (reading one file): {:.1f} ms\n", r.start_mib,
               r.start_from_snapshot_ms);
  if (r.forks > 0)
    fmt::print(
        "  fork({}): fork() returned after {:.0f} ms, all {} answered an exec after {:.0f} ms (median of {}; "
        "max {:.0f} ms)\n",
        r.forks, median(r.fork_call_ms), r.forks, median(r.fork_total_ms), r.fork_total_ms.size(),
        *std::max_element(r.fork_total_ms.begin(), r.fork_total_ms.end()));
}

std::string markdown_snapshot(const SnapshotBenchResult& r, int cores) {
  std::string md = "### Snapshot and fork\n\n";
  md +=
      "A busybox sandbox writes N files of 1 MiB of random bytes (the worst case for compression), then "
      "`Sandbox::snapshot` runs; medians. *frozen* is how long its processes stood still (the copy of its "
      "writable layer); *agent total* adds making the EROFS layer, compressing and storing its chunks and "
      "committing the manifest; *client* is the call as the trainer sees it.\n\n";
  md += "| written | runs | frozen | agent total | client | stored | MiB/s (agent total) |\n";
  md += "| --- | --- | --- | --- | --- | --- | --- |\n";
  for (const auto& p : r.sizes) {
    double total = median(p.agent_ms);
    md += fmt::format("| {} MiB | {} | {:.1f} ms | {:.0f} ms | {:.0f} ms | {:.1f} MiB | {:.0f} |\n", p.mib,
                      p.agent_ms.size(), median(p.frozen_ms), total, median(p.client_ms), p.stored_bytes / kMiB,
                      total > 0 ? static_cast<double>(p.mib) / (total / 1000) : 0.0);
  }
  if (r.start_from_snapshot_ms > 0)
    md += fmt::format(
        "\nA sandbox created from the {} MiB snapshot answered its first exec (reading one of the "
        "files) {:.0f} ms after the create call.\n",
        r.start_mib, r.start_from_snapshot_ms);
  if (r.forks > 0)
    md += fmt::format(
        "\n`Sandbox::fork({})` of a sandbox holding 1 MiB of state: `fork()` returned (snapshot, then "
        "`create_many`) after {:.0f} ms, and all {} forks had answered an exec after {:.0f} ms "
        "(median of {} rounds; slowest {:.0f} ms).\n",
        r.forks, median(r.fork_call_ms), r.forks, median(r.fork_total_ms), r.fork_total_ms.size(),
        *std::max_element(r.fork_total_ms.begin(), r.fork_total_ms.end()));
  md += fmt::format("\nLoad during this benchmark: {}.\n", load_text(r.cpu, cores));
  return md;
}

}  // namespace dsec::bench
