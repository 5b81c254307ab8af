// NumPy .npy files (format version 1.0, C order: little-endian float32, uint8 for the FP8
// codes of stage 06, int32 for the language model's token ids), for --dump and tests.
// Format: https://numpy.org/doc/stable/reference/generated/numpy.lib.format.html
//
// defines: tpx::NpyArray, tpx::NpyBytes, tpx::write_npy(), tpx::read_npy(), tpx::read_npy_bytes()
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

/// Writes `|u1` (uint8) data, likewise.
void write_npy(const std::filesystem::path& path, std::span<const std::uint8_t> data,
               const std::vector<std::int64_t>& shape);

/// Writes `<i4` (int32: token ids) data, likewise.
void write_npy(const std::filesystem::path& path, std::span<const std::int32_t> data,
               const std::vector<std::int64_t>& shape);

/// Reads a `<f4`, C-order .npy file; throws tpx::Error on anything else.
NpyArray read_npy(const std::filesystem::path& path);

struct NpyBytes {
  std::vector<std::int64_t> shape;
  std::vector<std::uint8_t> data;
};
/// Reads a `|u1`, C-order .npy file; throws tpx::Error on anything else.
NpyBytes read_npy_bytes(const std::filesystem::path& path);

}  // namespace tpx
