// NumPy .npy files (format version 1.0, little-endian float32, C order), for --dump and tests.
// Format: https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
//
// defines: tpx::NpyArray, tpx::write_npy(), tpx::read_npy()
#pragma once

#include <cstdint>
#include <filesystem>
#include <span>
#include <vector>

namespace tpx {

struct NpyArray {
  std::vector<std::int64_t> shape;
  std::vector<float> data;
};

/// Writes `<f4` data of the given shape, whole or not at all (write_file_atomically, output.h);
/// throws tpx::Error if the file cannot be written.
void write_npy(const std::filesystem::path& path, std::span<const float> data,
               const std::vector<std::int64_t>& shape);

/// Reads a `<f4`, C-order .npy file; throws tpx::Error on anything else.
NpyArray read_npy(const std::filesystem::path& path);

}  // namespace tpx
