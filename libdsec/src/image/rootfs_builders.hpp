// Root filesystem trees that image builds start from: a tiny busybox system, and Debian via debootstrap. Each writes
// a tree into a directory that the layer builder (build.hpp) then turns into an EROFS layer.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace dsec::image {

using LogSink = std::function<void(std::string_view line)>;

// A tiny system from the host's busybox-static at `dest` (which must not exist): /bin/busybox and a symlink per
// applet in /bin (/bin/sh among them), /sbin, /usr/bin and /usr/sbin linked to /bin, /etc/passwd and /etc/group with
// root, /tmp (1777), /root, and /proc /dev /sys /run /etc/hostname /etc/resolv.conf /etc/hosts as mount points.
// FAILED_PRECONDITION when the binary is missing or dynamically linked. Returns a description of the source.
std::string make_busybox_tree(const std::filesystem::path& dest, const std::filesystem::path& busybox,
                              std::vector<std::string>& notes);

// debootstrap --variant=minbase SUITE with extra packages from the Debian mirror (empty: the one this machine's apt
// sources use) at `dest` (which must not exist). The tree, with apt's package cache and lists, logs, documentation,
// manual pages, translations and the host's /etc/hostname, /etc/resolv.conf and /etc/hosts taken out, is cached as a
// tarball in `cache_dir` so a rebuild does not download again. Needs root. Returns a description of the source.
std::string make_debootstrap_tree(const std::filesystem::path& dest, const std::string& suite,
                                  const std::vector<std::string>& include_packages, const std::string& mirror,
                                  const std::filesystem::path& cache_dir, const LogSink& log,
                                  std::vector<std::string>& notes);

}  // namespace dsec::image
