#include "check.h"

#include <mpi.h>
#include <unistd.h>

#include <array>
#include <filesystem>

namespace tpx {

std::string where_am_i() {
  std::array<char, 256> host{};
  if (gethostname(host.data(), host.size() - 1) != 0) host = {'?'};
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return host.data();
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return fmt::format("{} rank {}", host.data(), rank);
}

void fail(std::string_view message, std::source_location loc) {
  const auto file = std::filesystem::path(loc.file_name()).filename().string();
  throw Error(fmt::format("{}:{} [{}] {}", file, loc.line(), where_am_i(), message));
}

void fail_mpi(int code, std::string_view call, std::source_location loc) {
  std::array<char, MPI_MAX_ERROR_STRING> text{};
  int len = 0;
  MPI_Error_string(code, text.data(), &len);
  fail(fmt::format("{} failed: {}", call, std::string_view(text.data(), len)), loc);
}

}  // namespace tpx
