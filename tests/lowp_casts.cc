// The casts of common/fp8_bits.h and common/lowp_bits.h as tables, for tests/lowp_ml_dtypes.py to
// compare with an independent implementation (ml_dtypes):
//
//   lowp_casts INPUTS.npy OUTDIR
//
// INPUTS.npy: float32 values, any shape. Writes into OUTDIR (which must exist):
//   <f>.decode.npy   float32, the value of every code of format f (256 codes; 16 for e2m1)
//   <f>.encode.npy   uint8, the code of every input, one per input in input order
// for f in e4m3, e5m2, e2m1, ue4m3 and e8m0 (whose encode is e8m0_floor, the MX scale's rounding).
// Exit status 0, or 2 with one line on bad arguments or an unreadable file.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "common/fp8_bits.h"
#include "common/lowp_bits.h"
#include "common/npy.h"

namespace {

struct Cast {
  const char* name;
  int codes;
  std::function<float(std::uint8_t)> decode;
  std::function<std::uint8_t(float)> encode;
};

}  // namespace

int main(int argc, char** argv) {
  using namespace tpx;
  if (argc != 3) {
    std::fprintf(stderr, "lowp_casts: usage: lowp_casts INPUTS.npy OUTDIR\n");
    return 2;
  }
  const std::filesystem::path out = argv[2];
  try {
    const NpyArray inputs = read_npy(argv[1]);
    const std::vector<Cast> casts{
        {"e4m3", 256, [](std::uint8_t c) { return fp8::decode(c, fp8::kE4M3); },
         [](float v) { return fp8::encode(v, fp8::kE4M3); }},
        {"e5m2", 256, [](std::uint8_t c) { return fp8::decode(c, fp8::kE5M2); },
         [](float v) { return fp8::encode(v, fp8::kE5M2); }},
        {"e2m1", 16, lowp::e2m1_decode, lowp::e2m1_encode},
        {"ue4m3", 256, lowp::ue4m3_decode, lowp::ue4m3_encode},
        {"e8m0", 256, lowp::e8m0_decode, lowp::e8m0_floor},
    };
    for (const Cast& cast : casts) {
      std::vector<float> values(static_cast<std::size_t>(cast.codes));
      for (int c = 0; c < cast.codes; ++c)
        values[static_cast<std::size_t>(c)] = cast.decode(static_cast<std::uint8_t>(c));
      write_npy(out / (std::string(cast.name) + ".decode.npy"), values, {cast.codes});
      std::vector<std::uint8_t> codes(inputs.data.size());
      for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = cast.encode(inputs.data[i]);
      write_npy(out / (std::string(cast.name) + ".encode.npy"), codes,
                {static_cast<std::int64_t>(codes.size())});
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lowp_casts: %s\n", e.what());
    return 2;
  }
  return 0;
}
