// What the benchmarks of the QEMU tiers (dsec-bench microvm and vm) share: agents of their own, their VMs' QEMU
// processes and memory cgroups, and sections that record the load they ran under and carry on past a failure.
#pragma once

#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "bench.hpp"
#include "dsec/sandbox.hpp"

namespace dsec::bench {

inline constexpr double kMiB = 1024.0 * 1024.0;
inline constexpr double kGiB = kMiB * 1024.0;

using SectionLoads = std::vector<std::pair<std::string, std::string>>;  // a section's name -> its CPU and load

std::string trim(std::string s);
std::string mib(double bytes);  // "12.3 MiB"; "n/a" for NaN
std::string ms(double v);       // "4.56 ms", "45.6 ms", "456 ms"; "n/a" for NaN

// A process's argv, and the word after `flag` in it (empty when absent).
std::vector<std::string> cmdline_of(int pid);
std::string arg_after(const std::vector<std::string>& argv, const std::string& flag);

// The first line of `qemu-system-x86_64 --version`.
std::string qemu_version();

std::string load_text();  // the load averages now, "1.23 0.80 0.51"
double load1_now();

// Every "Key: N kB" of a /proc file, in bytes.
std::map<std::string, double> kb_fields(const std::string& path);
// A key of a cgroup's memory.stat ("shmem"), in bytes; NaN when unreadable.
double memory_stat(const std::string& dir, const std::string& key);
// Memory charged to a sandbox's memory cgroup (found through its processes); NaN when not found.
double vm_charged(const std::string& id);
// The pages of the templates' memfds the agent holds (descriptors named memfd:dsec-ram-template-...), each once.
double template_resident_bytes(int agent_pid);
// Memory charged to an agent's cgroup subtree (v1 memory.usage_in_bytes, v2 memory.current); NaN when not found.
double subtree_charge(const std::string& cgroup_name);
// The QEMU processes in an agent's cgroup subtree, by the sandbox id their -name gives.
std::map<std::string, int> agent_qemus(const std::string& cgroup_name);

ExecRequest true_request(double timeout = 60);
// Throws INTERNAL naming `what` unless the command exited 0 in time.
void check_ok(const ExecResult& r, const std::string& what);
ExecResult run_shell(const Sandbox& sb, const std::string& command, double timeout_seconds = 300);
// Destroys them all, `threads` at a time; the errors go to `errors` when given. Empties `vms`.
void destroy_all(std::vector<Sandbox>& vms, std::size_t threads, std::vector<std::string>* errors = nullptr);

// An agent a QEMU tier's benchmark starts for itself (an embedded dsecd with its own run directory, records and
// cgroup subtree, on the benchmark's home), once its accelerator probe for `kind` is done.
struct Agent {
  std::string label;
  std::string kind;  // the QEMU tier measured: "microvm" or "vm"
  std::unique_ptr<Client> client;
  int pid = -1;
  std::filesystem::path run_dir;
  std::string cgroup_name;
  NodeInfo node;

  const QemuTierNodeInfo& tier() const { return kind == "vm" ? node.vm : node.microvm; }
  ~Agent();
};

// Starts dsecd with `args` (its --backends among them) and waits until it serves `kind` and its accelerator probe
// has finished; FAILED_PRECONDITION when it cannot run VMs of that kind. `stores`: the client's image stores (and
// the agent's), empty for <home>/store alone.
std::unique_ptr<Agent> start_agent(const Options& o, const std::string& home, const std::string& label,
                                   const std::string& kind, std::vector<std::string> args,
                                   std::vector<std::string> stores = {});

// A new directory /tmp/<prefix>-XXXXXX, removed with all it holds when this goes.
struct ScratchDir {
  explicit ScratchDir(const std::string& prefix);
  ~ScratchDir();
  ScratchDir(const ScratchDir&) = delete;
  ScratchDir& operator=(const ScratchDir&) = delete;
  std::filesystem::path dir;
};

// One section of a benchmark: announced with the load, its CPU and the load at its end recorded in `section_load`
// under `name`; a failure becomes a line of `problems` and the run goes on.
struct Sections {
  std::string command;  // "microvm", "vm": the prefix of the progress lines
  int cores = 0;
  SectionLoads& section_load;
  std::vector<std::string>& problems;

  void run(const std::string& name, const std::vector<int>& pids, const std::function<void()>& body) const;
};

// A CpuUse as one line, with the load average at the end.
std::string cpu_line(const CpuUse& c, int cores);

// The end of a QEMU tier's report, as text and as Markdown: the load each section ran under, the notes, and the
// problems seen, marked with the accelerator.
void print_run_log(const std::string& accelerator, const SectionLoads& section_load,
                   const std::vector<std::string>& notes, const std::vector<std::string>& problems);
std::string markdown_run_log(const std::string& accelerator, const SectionLoads& section_load,
                             const std::vector<std::string>& notes, const std::vector<std::string>& problems);

}  // namespace dsec::bench
