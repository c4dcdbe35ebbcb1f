// dsec-init: pid 1 of every sandbox that runs processes, in a container or in a virtual machine.
//
// In a VM the kernel runs it from the initramfs with `dsec_guest=1` (a microVM) or `dsec_guest=boot` (a full VM) on
// its command line (which the kernel hands to init as an environment variable); a full VM's systemd starts it again
// with `dsec_guest=service`; in a container the agent starts it with the listening init.sock as descriptor 3.
#include <cstdlib>
#include <cstring>

#include "init/init_main.hpp"

int main() {
  const char* guest = std::getenv("dsec_guest");
  if (guest && std::strcmp(guest, "1") == 0) return dsec::init::run_guest_init();
  if (guest && std::strcmp(guest, "boot") == 0) dsec::init::run_guest_boot();
  if (guest && std::strcmp(guest, "service") == 0) return dsec::init::run_guest_service();
  return dsec::init::run_container_init();
}
