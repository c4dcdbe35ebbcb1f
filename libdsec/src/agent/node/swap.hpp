// Swap for sleeping sandboxes. A sleeping sandbox gives its memory back by having its pages pushed out of RAM; page
// cache can simply be dropped, but anonymous memory (heaps, stacks) and the sandbox's writable layer (a tmpfs) can
// only go to swap. dsecd sets the node's swap up itself when told to (dsecd --swap-file PATH --swap-size SIZE,
// --zram-size SIZE) and turns off, at a clean shutdown, the swap areas it turned on; swap it found on is never
// touched. docs/node.md describes the flags and the choices.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::agent {

struct SwapOptions {
  std::filesystem::path file;  // a swap file (empty: none); made when missing, reused when it is one of the size
  std::uint64_t file_bytes = 0;
  std::uint64_t zram_bytes = 0;  // a compressed RAM swap device of this (uncompressed) size; 0: none
  std::string zram_algorithm;    // empty: lz4 when the kernel offers it, else the device's default
  // The volume label written into the swap areas dsecd makes. An area found already on with this label was left by
  // a dsecd that did not shut down cleanly: the agent takes it as its own (and turns it off at shutdown).
  std::string label = "dsecd";
};

// SwapTotal and SwapFree of /proc/meminfo: every swap area of the host, not only the agent's.
struct SwapTotals {
  std::uint64_t total_bytes = 0;
  std::uint64_t free_bytes = 0;
};
SwapTotals read_swap_totals();
SwapTotals parse_meminfo_swap(std::string_view meminfo);

// One line of /proc/swaps.
struct ActiveSwap {
  std::string path;  // unescaped ("\040" is a space)
  std::string type;  // "file" or "partition"
  std::uint64_t size_bytes = 0;
  std::uint64_t used_bytes = 0;
  int priority = 0;
};
std::vector<ActiveSwap> parse_proc_swaps(std::string_view text);
std::vector<ActiveSwap> read_proc_swaps();

// The first page of a swap area as mkswap writes it (version 1, no bad pages, "SWAPSPACE2" at its end) for an area
// of `bytes` (rounded down to whole pages), with the given label (at most 16 bytes) and uuid.
std::string make_swap_header(std::uint64_t bytes, std::size_t page_size, std::string_view label,
                             const unsigned char (&uuid)[16]);
struct SwapHeader {
  bool valid = false;       // the SWAPSPACE2 magic and version 1
  std::uint64_t pages = 0;  // pages the area spans (its last page + 1), header included
  std::string label;
};
SwapHeader parse_swap_header(std::string_view first_page);

// The name of the filesystem that holds `dir` ("ext4", "tmpfs", ... or "0x1234abcd"), and whether a swap file may
// live on it: tmpfs, ramfs, overlayfs, FUSE, network and read-only image filesystems cannot hold one.
struct SwapFilesystem {
  std::string name;
  bool can_hold_swap = true;
};
SwapFilesystem swap_filesystem(const std::filesystem::path& dir);

// The swap areas of one agent: set up in the constructor, turned off by turn_off() or the destructor.
class NodeSwap {
 public:
  // Sets up what `options` asks for. Throws dsec::Error: INVALID_ARGUMENT for bad options, FAILED_PRECONDITION for a
  // path on a filesystem that cannot hold swap, an existing file that is not a swap area, or a zram device in use;
  // PERMISSION_DENIED without CAP_SYS_ADMIN; RESOURCE_EXHAUSTED when the disk has no room for the file. What it
  // turned on before failing is turned off again.
  explicit NodeSwap(const SwapOptions& options);
  NodeSwap(const NodeSwap&) = delete;
  NodeSwap& operator=(const NodeSwap&) = delete;
  ~NodeSwap();

  // Turns off the swap areas this agent owns (those it turned on, and those with its label it found on) and removes
  // the zram device it added. Pages in them come back into RAM first, which takes as long as reading them. Never
  // throws (failures are logged); idempotent.
  void turn_off() noexcept;
  // One line per area, for the log.
  const std::vector<std::string>& summary() const noexcept { return summary_; }

 private:
  struct Area {
    std::string path;         // the swap file or /dev/zramN
    bool owned = false;       // turned off by turn_off()
    int zram_id = -1;         // the zram device to reset (-1: a file)
    bool zram_added = false;  // hot-added by this agent: removed again by turn_off()
  };
  void setup_file(const SwapOptions& options);
  void setup_zram(const SwapOptions& options);

  std::vector<Area> areas_;
  std::vector<std::string> summary_;
};

}  // namespace dsec::agent
