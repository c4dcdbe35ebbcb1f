// dsec-init's lives: pid 1 of a container sandbox (container_init.cpp); in a virtual machine, its pid 1 (a microVM:
// guest_init.cpp), or a full VM's initramfs /init that builds the root and starts the image's own init
// (guest_boot.cpp) and then the guest agent as that init's service (guest_init.cpp). One binary, linked statically
// so it needs nothing from the image; main() picks by how it was started.
#pragma once

namespace dsec::init {

int run_container_init();
int run_guest_init();
[[noreturn]] int run_guest_boot();
int run_guest_service();

}  // namespace dsec::init
