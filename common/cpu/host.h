// The host CPU as the headers, --json summaries and the benchmark page name it.
//
// defines: tpx::cpu::host_cpu_name()
#pragma once

#include <string>

namespace tpx::cpu {

/// "<model name> (cpu family F, model M, stepping S), N cores" from /proc/cpuinfo (the first
/// processor's fields; a virtual machine may name only the vendor, so the family, model and
/// stepping say which CPU) and the number of processors; "unknown cpu, N cores" without it.
std::string host_cpu_name();

}  // namespace tpx::cpu
