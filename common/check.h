// Error reporting for tpx: every failure names the file, line, host and rank that raised it.
//
// defines: tpx::Error, tpx::ConfigError, tpx::fail(), TPX_CHECK, TPX_MPI_CHECK
#pragma once

#include <source_location>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fmt/format.h>

namespace tpx {

/// The exception type of the library. what() is one self-contained line.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// A config error every rank sees identically: printed by each, no abort needed. Below the
/// stages and the communicators alike: either may find one.
class ConfigError : public Error {
 public:
  using Error::Error;
};

/// "host:rank" of the calling process ("host" before MPI is initialised).
std::string where_am_i();

/// Throws tpx::Error with "file:line [host rank r] message".
[[noreturn]] void fail(std::string_view message,
                       std::source_location loc = std::source_location::current());

/// Throws a tpx::Error naming the failed MPI call and MPI's own error string.
[[noreturn]] void fail_mpi(int code, std::string_view call,
                           std::source_location loc = std::source_location::current());

}  // namespace tpx

/// Checks a condition; on failure throws tpx::Error with a formatted message.
#define TPX_CHECK(cond, ...)                                                              \
  do {                                                                                    \
    if (!(cond))                                                                          \
      ::tpx::fail(fmt::format("check '{}' failed: {}", #cond, fmt::format(__VA_ARGS__))); \
  } while (0)

/// Wraps an MPI call; on an error code throws tpx::Error naming the call.
#define TPX_MPI_CHECK(call)                                    \
  do {                                                         \
    int tpx_mpi_rc_ = (call);                                  \
    if (tpx_mpi_rc_ != 0) ::tpx::fail_mpi(tpx_mpi_rc_, #call); \
  } while (0)
