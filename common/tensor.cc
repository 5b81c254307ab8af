#include "tensor.h"

#include <array>
#include <bit>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "check.h"
#include "checked.h"
#if TPX_WITH_CUDA
#include "cuda/device.h"
#endif

namespace tpx {

std::size_t dtype_size(DType d) {
  switch (d) {
    case DType::f32:
    case DType::i32:
      return 4;
    case DType::bf16:
      return 2;
    case DType::e4m3:
    case DType::e5m2:
    case DType::u8:
      return 1;
  }
  fail("unknown dtype");
}

std::string_view to_string(DType d) {
  switch (d) {
    case DType::f32:
      return "fp32";
    case DType::bf16:
      return "bf16";
    case DType::e4m3:
      return "e4m3";
    case DType::e5m2:
      return "e5m2";
    case DType::u8:
      return "u8";
    case DType::i32:
      return "i32";
  }
  return "?";
}

std::string_view to_string(Device d) {
  return d == Device::cpu ? "cpu" : "cuda";
}

DType parse_dtype(std::string_view s) {
  if (s == "fp32" || s == "f32") return DType::f32;
  if (s == "bf16") return DType::bf16;
  if (s == "fp8") return DType::e4m3;  // the FP8 recipe: E4M3 forward, E5M2 gradients
  fail(fmt::format("unknown dtype '{}' (expected fp32, bf16 or fp8)", s));
}

Device parse_device(std::string_view s) {
  if (s == "cpu") return Device::cpu;
  if (s == "cuda") return Device::cuda;
  fail(fmt::format("unknown device '{}' (expected cpu or cuda)", s));
}

std::uint16_t bf16_bits(float f) {
  const auto u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep sign and payload, make it quiet
    return static_cast<std::uint16_t>((u >> 16) | 0x0040u);
  }
  const std::uint32_t round = 0x7fffu + ((u >> 16) & 1u);  // ties go to the even neighbour
  return static_cast<std::uint16_t>((u + round) >> 16);
}

float bf16_value(std::uint16_t bits) {
  return std::bit_cast<float>(std::uint32_t{bits} << 16);
}

namespace {

/// Blocks of this many bytes or more are mapped by malloc for themselves and unmapped when
/// freed. Left to itself, glibc's malloc raises that threshold to the largest block freed (up to
/// 32 MiB) and serves the blocks under it from its heaps, where a freed block stays resident, a
/// hole under the live blocks above it: the process held up to twice what the allocator counts
/// (stage 08 at H 256, S 128), MPI's own staging buffers in the comm lanes' heaps too. Setting
/// the threshold fixes it there, for every malloc of the process.
constexpr int kOwnMapping = 64 << 10;

void fix_malloc_mmap_threshold() {
#if defined(__GLIBC__)
  mallopt(M_MMAP_THRESHOLD, kOwnMapping);
#endif
}

/// Host memory, 64-byte aligned (a cache line; also what AVX-512 loads like). The process's
/// pages are the blocks in use: a freed tensor of kOwnMapping bytes or more leaves the process.
/// Thread-safe: a cpu stream's thread allocates beside the calling thread (stage 10's EP lane
/// receives rows while the experts run), so the counts are kept under a lock.
class CpuAllocator final : public Allocator {
 public:
  CpuAllocator() { fix_malloc_mmap_threshold(); }

  void* allocate(std::size_t bytes) override {
    const std::size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    if (p == nullptr) fail(fmt::format("out of host memory allocating {} bytes", bytes));
    std::lock_guard lock(mutex_);
    stats_.current += bytes;
    stats_.peak = std::max(stats_.peak, stats_.current);
    return p;
  }
  void deallocate(void* ptr, std::size_t bytes) override {
    std::free(ptr);
    std::lock_guard lock(mutex_);
    stats_.current -= bytes;
  }
  MemoryStats stats() const override {
    std::lock_guard lock(mutex_);
    MemoryStats s = stats_;
    s.reserved = s.current;  // no cache: every byte held is in use
    return s;
  }
  void reset_peak() override {
    std::lock_guard lock(mutex_);
    stats_.peak = stats_.current;
  }

 private:
  mutable std::mutex mutex_;
  MemoryStats stats_;
};

std::array<Allocator*, 2>& registry() {
  static CpuAllocator cpu;
  static std::array<Allocator*, 2> r{&cpu, nullptr};
  return r;
}

}  // namespace

Allocator& allocator_for(Device d) {
  Allocator* a = registry()[static_cast<std::size_t>(d)];
#if TPX_WITH_CUDA
  if (a == nullptr && d == Device::cuda) {  // first cuda use: the backend registers its allocator
    cuda::ensure_initialized();
    a = registry()[static_cast<std::size_t>(d)];
  }
#endif
  if (a == nullptr)
    fail(fmt::format("no allocator for device {} (backend not built or not initialised)",
                     to_string(d)));
  return *a;
}

void register_allocator(Device d, Allocator* a) {
  registry()[static_cast<std::size_t>(d)] = a;
}

struct Tensor::Storage {
  void* ptr = nullptr;
  std::size_t bytes = 0;
  Device device = Device::cpu;
  std::shared_ptr<const void> owner;  // set for borrowed memory, which the allocator never saw
  Storage(std::size_t n, Device d) : ptr(allocator_for(d).allocate(n)), bytes(n), device(d) {}
  Storage(void* p, std::size_t n, Device d, std::shared_ptr<const void> o)
      : ptr(p), bytes(n), device(d), owner(std::move(o)) {}
  ~Storage() {
    if (!owner) allocator_for(device).deallocate(ptr, bytes);
  }
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
};

Tensor Tensor::empty(Shape shape, DType dtype, Device device) {
  for (auto d : shape)
    TPX_CHECK(d >= 0, "negative dimension in shape [{}]", fmt::join(shape, ", "));
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = std::make_shared<Storage>(t.nbytes(), device);
  return t;
}

Tensor Tensor::borrow(void* ptr, Shape shape, DType dtype, Device device,
                      std::shared_ptr<const void> owner) {
  TPX_CHECK(owner != nullptr, "Tensor::borrow needs an owner to keep the memory alive");
  Tensor t;
  t.shape_ = std::move(shape);
  t.dtype_ = dtype;
  t.device_ = device;
  t.storage_ = std::make_shared<Storage>(ptr, t.nbytes(), device, std::move(owner));
  return t;
}

Tensor Tensor::zeros(Shape shape, DType dtype) {
  Tensor t = empty(std::move(shape), dtype, Device::cpu);
  std::memset(t.raw(), 0, t.nbytes());
  return t;
}

std::int64_t Tensor::dim(int i) const {
  TPX_CHECK(i >= 0 && i < ndim(), "dim {} of a {}-d tensor", i, ndim());
  return shape_[static_cast<std::size_t>(i)];
}

std::int64_t Tensor::numel() const {
  std::int64_t n = 1;
  for (const std::int64_t d : shape_) {
    const auto next = checked_mul(n, d);
    if (!next)
      throw SizeOverflow(fmt::format("a tensor of shape [{}] has more elements than fit in 64 bits",
                                     fmt::join(shape_, ", ")));
    n = *next;
  }
  return n;
}

std::size_t Tensor::nbytes() const {
  const auto bytes = checked_mul(static_cast<std::int64_t>(dtype_size(dtype_)), numel());
  if (!bytes) throw SizeOverflow(fmt::format("{} has more bytes than fit in 64 bits", describe()));
  return static_cast<std::size_t>(*bytes);
}

std::int64_t Tensor::cols() const {
  return shape_.empty() ? 1 : shape_.back();
}
std::int64_t Tensor::rows() const {
  return cols() == 0 ? 0 : numel() / cols();
}

void* Tensor::raw() const {
  TPX_CHECK(defined(), "use of an undefined tensor");
  return static_cast<char*>(storage_->ptr) + offset_;
}

void* Tensor::storage_ptr() const {
  TPX_CHECK(defined(), "use of an undefined tensor");
  return storage_->ptr;
}

void Tensor::check_element_size(std::size_t bytes) const {
  TPX_CHECK(bytes == dtype_size(dtype_), "element size {} does not match dtype {}", bytes,
            to_string(dtype_));
}

void Tensor::check_float() const {
  TPX_CHECK(dtype_ != DType::i32, "float pointer into an i32 tensor {}", describe());
}

void Tensor::check_int32() const {
  TPX_CHECK(dtype_ == DType::i32, "int32 pointer into a {} tensor", describe());
}

std::span<float> Tensor::f32() const {
  TPX_CHECK(dtype_ == DType::f32 && device_ == Device::cpu, "f32() needs an f32 cpu tensor, got {}",
            describe());
  return {data<float>(), static_cast<std::size_t>(numel())};
}

Tensor Tensor::slice0(std::int64_t begin, std::int64_t end) const {
  TPX_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "slice0({}, {}) of {}",
            begin, end, describe());
  Tensor t = *this;
  const std::int64_t row = numel() / std::max<std::int64_t>(shape_[0], 1);
  t.offset_ += static_cast<std::size_t>(begin * row) * dtype_size(dtype_);
  t.shape_[0] = end - begin;
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  Tensor t = *this;
  t.shape_ = std::move(shape);
  TPX_CHECK(t.numel() == numel(), "reshape of {} to {} elements", describe(), t.numel());
  return t;
}

Tensor Tensor::with_scale(const Tensor& scale) const {
  TPX_CHECK(is_fp8(dtype_), "with_scale on {}: only FP8 tensors carry a scale", describe());
  TPX_CHECK(scale.dtype() == DType::f32 && scale.numel() == 1 && scale.device() == device_,
            "the scale of {} must be f32[1] on {}, got {}", describe(), to_string(device_),
            scale.describe());
  Tensor t = *this;
  t.scale_ = std::make_shared<const Tensor>(scale);
  return t;
}

std::string Tensor::describe() const {
  return fmt::format("{}[{}] on {}", to_string(dtype_), fmt::join(shape_, ", "),
                     to_string(device_));
}

}  // namespace tpx
