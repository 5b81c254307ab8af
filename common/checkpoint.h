// Checkpoints: the primitives of the on-disk format (DESIGN.md, "Checkpoints").
//
// A checkpoint is a directory DIR/step-<N>/ with each rank's shard files and one index.json that
// names every tensor's global shape, dtype and each shard's file, byte offset, global ranges and
// checksum. This file holds what the format is built on: the checksum every shard carries.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tpx {

// CRC-32 (IEEE 802.3, reflected polynomial 0xEDB88320, initial value and final xor 0xFFFFFFFF) of
// `n` bytes. `crc` continues an earlier call: crc32(b, n2, crc32(a, n1)) is the CRC of a then b,
// so a shard written in pieces has the checksum of its whole bytes.
std::uint32_t crc32(const void* data, std::size_t n, std::uint32_t crc = 0);

}  // namespace tpx
