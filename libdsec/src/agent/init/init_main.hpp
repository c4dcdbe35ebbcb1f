// dsec-init's two lives: pid 1 of a container sandbox (container_init.cpp) and pid 1 of a virtual machine
// (guest_init.cpp). One binary, linked statically so it needs nothing from the image; main() picks by how it was
// started.
#pragma once

namespace dsec::init {

int run_container_init();
int run_guest_init();

}  // namespace dsec::init
