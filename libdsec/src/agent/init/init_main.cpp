// dsec-init: pid 1 of every sandbox that runs processes, in a container or in a virtual machine.
//
// In a VM the kernel runs it from the initramfs with `dsec_guest=1` on its command line (which the kernel hands to
// init as an environment variable); in a container the agent starts it with the listening init.sock as descriptor 3.
#include <cstdlib>
#include <cstring>

#include "agent/init/init_main.hpp"

int main() {
  const char* guest = std::getenv("dsec_guest");
  if (guest && std::strcmp(guest, "1") == 0) return dsec::init::run_guest_init();
  return dsec::init::run_container_init();
}
