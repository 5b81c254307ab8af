// Tensor: a shaped, typed view of device memory owned through the library's allocator.
//
// defines: tpx::DType, tpx::Device, tpx::MemoryStats, tpx::Allocator, tpx::Tensor,
//          tpx::bf16_bits, tpx::bf16_value
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace tpx {

/// Element types. Ops compute in f32; bf16 is the mixed-precision recipe's storage, E4M3 / E5M2
/// the FP8 stage's (OCP), u8 plain bytes (a buffer that packs tensors of several dtypes, as
/// stage 07's weight gathers do), and i32 the language model's token ids.
enum class DType : std::uint8_t { f32, bf16, e4m3, e5m2, u8, i32 };

/// Where a tensor's bytes live.
enum class Device : std::uint8_t { cpu, cuda };

std::size_t dtype_size(DType d);
/// E4M3 or E5M2.
constexpr bool is_fp8(DType d) {
  return d == DType::e4m3 || d == DType::e5m2;
}
std::string_view to_string(DType d);
std::string_view to_string(Device d);
DType parse_dtype(std::string_view s);    ///< "fp32" | "f32" | "bf16" | "fp8" (e4m3); else throws
Device parse_device(std::string_view s);  ///< "cpu" | "cuda"; throws on anything else

/// bf16 (the top 16 bits of an IEEE float) from a float, rounding to nearest even; NaN stays NaN.
/// The same rounding as CUDA's __float2bfloat16_rn, so host code can predict device casts.
std::uint16_t bf16_bits(float f);
/// The float a bf16 bit pattern stands for (exact).
float bf16_value(std::uint16_t bits);

/// Bytes currently held and the high-water mark, per device.
struct MemoryStats {
  std::size_t current = 0;   ///< bytes handed out and not returned
  std::size_t peak = 0;      ///< the high-water mark of current
  std::size_t reserved = 0;  ///< bytes held from the system, cached blocks included
};

/// The allocator interface every backend implements. It counts what it hands out.
class Allocator {
 public:
  virtual ~Allocator() = default;
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* ptr, std::size_t bytes) = 0;
  virtual MemoryStats stats() const = 0;
  virtual void reset_peak() = 0;
  /// Work on `stream` (a native stream handle) uses the block at `ptr` (as returned by
  /// allocate()): once the block is freed, it must not be handed out again before that stream has
  /// passed the free. Allocators whose memory cannot be reused early ignore it.
  virtual void record_stream(void* /*ptr*/, void* /*stream*/) {}
};

/// The process-wide allocator for a device (the CUDA one exists only when CUDA is built).
Allocator& allocator_for(Device d);

/// Installs the allocator for a device; used by the CUDA backend at start-up.
void register_allocator(Device d, Allocator* a);

/// A tensor is a handle: copying it shares storage. Shapes are row-major (C order).
class Tensor {
 public:
  using Shape = std::vector<std::int64_t>;

  Tensor() = default;
  /// Uninitialised storage of the given shape from allocator_for(device).
  static Tensor empty(Shape shape, DType dtype = DType::f32, Device device = Device::cpu);
  /// Zero-filled host storage. There is deliberately no device argument: zeroing device memory
  /// is work that must be ordered on the stream that uses the tensor, which is what ops::fill
  /// does (Tensor::empty(shape, dtype, device), then ops::fill(t, 0.0f)). A device tensor asked
  /// of zeros() is a compile error, not a failure on the first run that has a GPU.
  static Tensor zeros(Shape shape, DType dtype = DType::f32);
  /// A view of memory the allocator does not own (a symmetric-memory buffer): `owner` is kept
  /// alive as long as any view of it, and nothing is freed or counted by the allocator.
  static Tensor borrow(void* ptr, Shape shape, DType dtype, Device device,
                       std::shared_ptr<const void> owner);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  std::int64_t dim(int i) const;
  int ndim() const { return static_cast<int>(shape_.size()); }
  std::int64_t numel() const;
  /// Element and byte counts; a shape whose count does not fit in 64 bits throws SizeOverflow.
  std::size_t nbytes() const;
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }

  /// Rows and columns of the tensor seen as a matrix: [numel / last dim, last dim].
  std::int64_t rows() const;
  std::int64_t cols() const;

  /// Raw pointer to the first element (device pointer for cuda tensors).
  void* raw() const;
  /// The start of the allocation this tensor views (what the allocator handed out).
  void* storage_ptr() const;
  /// Typed pointer; checks that T matches the dtype's size, and that the tensor is f32 when T is
  /// float and i32 when T is std::int32_t.
  template <class T>
  T* data() const;
  /// Host-side span over f32 data (cpu tensors only).
  std::span<float> f32() const;

  /// A view of rows [begin, end) of dim 0 sharing this tensor's storage: a sequence shard.
  Tensor slice0(std::int64_t begin, std::int64_t end) const;
  /// The same storage with another shape of equal element count.
  Tensor reshape(Shape shape) const;

  /// This FP8 tensor with its per-tensor scale attached: `scale` is f32 [1] on the same device,
  /// and element q stands for the value q / scale (DESIGN.md, "06 — FP8"). Views made from the
  /// result (slice0, reshape) keep the scale: every chunk of a gathered tensor shares it.
  Tensor with_scale(const Tensor& scale) const;
  /// The attached scale; an undefined tensor when there is none.
  Tensor scale() const { return scale_ ? *scale_ : Tensor(); }

  std::string describe() const;  ///< e.g. "f32[128, 2, 256] on cpu"

 private:
  void check_element_size(std::size_t bytes) const;
  void check_float() const;  // f32, or an FP8 scale's f32
  void check_int32() const;

  struct Storage;
  std::shared_ptr<Storage> storage_;
  std::shared_ptr<const Tensor> scale_;  // FP8 only (with_scale)
  std::size_t offset_ = 0;               // in bytes
  Shape shape_;
  DType dtype_ = DType::f32;
  Device device_ = Device::cpu;
};

template <class T>
T* Tensor::data() const {
  check_element_size(sizeof(T));
  if constexpr (std::is_same_v<std::remove_cv_t<T>, float>) check_float();
  if constexpr (std::is_same_v<std::remove_cv_t<T>, std::int32_t>) check_int32();
  return static_cast<T*>(raw());
}

}  // namespace tpx
