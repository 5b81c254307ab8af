// CUDA streams against the rules the stages rely on: work issued on one stream runs in issue
// order; an Event orders a consumer stream after a producer stream; a block freed after
// record_stream() is not handed out again before the recording stream has passed the free (and,
// as a control, without record_stream it is handed out at once); free lists are per stream; and
// GEMMs running concurrently on two streams (each with its own cuBLAS/cuBLASLt workspace) give
// the results of the same GEMMs run one after the other. Every test needs a GPU and skips with
// the reason when none is visible. ctest names them cuda.<Suite>.<Test>.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

#include "common/cuda/allocator.h"
#include "common/cuda/check.h"
#include "common/cuda/device.h"
#include "common/ops.h"
#include "common/stream.h"
#include "test_cuda.h"
#include "test_util.h"

namespace tpx {
namespace {

using test::random_tensor;
using I = std::int64_t;

using test::gpu_empty;
using test::on_cpu;
using test::on_gpu;

/// max |got − want| / max |want|, got from any device.
double rel_err(const Tensor& got, const Tensor& want) {
  const Tensor g = on_cpu(got), w = on_cpu(want);
  EXPECT_EQ(g.numel(), w.numel());
  double err = 0.0, scale = 0.0;
  auto gs = g.f32(), ws = w.f32();
  for (std::size_t i = 0; i < ws.size() && i < gs.size(); ++i) {
    err = std::max(err, std::abs(double(gs[i]) - double(ws[i])));
    if (std::isnan(gs[i])) err = INFINITY;
    scale = std::max(scale, std::abs(double(ws[i])));
  }
  return scale > 0 ? err / scale : err;
}

/// A cpu tensor of small integers (exact in every sum the tests form).
Tensor small_integers(Tensor::Shape shape, int modulus, int offset) {
  Tensor t = Tensor::empty(std::move(shape));
  auto v = t.f32();
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = static_cast<float>(static_cast<int>(i * 7 % static_cast<std::size_t>(modulus)) - offset);
  return t;
}

cuda::CachingAllocator& caching_allocator() {
  return dynamic_cast<cuda::CachingAllocator&>(allocator_for(Device::cuda));
}

/// Holds a stream at the point where it was created until open(): a host function enqueued on
/// the stream spins on a flag. The destructor opens the gate and drains the stream, so a failed
/// check never leaves the stream blocked; after 60 s the gate gives up and opens by itself.
/// Nothing that may synchronise the device (cudaFree, a first kernel launch under lazy module
/// loading) may be issued while a gate is closed.
class HostGate {
 public:
  explicit HostGate(const Stream& s) : stream_(s) {
    TPX_CUDA_CHECK(
        cudaLaunchHostFunc(static_cast<cudaStream_t>(stream_.native()), &HostGate::wait, this));
  }
  ~HostGate() {
    open();
    (void)cudaStreamSynchronize(static_cast<cudaStream_t>(stream_.native()));
  }
  HostGate(const HostGate&) = delete;
  HostGate& operator=(const HostGate&) = delete;

  void open() { open_.store(true); }
  bool timed_out() const { return timed_out_.load(); }

 private:
  static void CUDART_CB wait(void* self) {
    auto* gate = static_cast<HostGate*>(self);
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (!gate->open_.load()) {
      if (std::chrono::steady_clock::now() > give_up) {
        gate->timed_out_.store(true);
        return;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }

  Stream stream_;
  std::atomic<bool> open_{false}, timed_out_{false};
};

TEST(Streams, WorkOnAStreamRunsInIssueOrder) {
  TPX_REQUIRE_GPU();
  constexpr I n = 256;
  constexpr int steps = 20;
  Tensor two_host = Tensor::zeros({n, n});
  for (I i = 0; i < n; ++i) two_host.f32()[static_cast<std::size_t>(i * n + i)] = 2.0f;
  const Tensor two = on_gpu(two_host);
  const Tensor y = gpu_empty({n, n}), tmp = gpu_empty({n, n}), ones = gpu_empty({n, n});
  const Stream s = Stream::create(Device::cuda);
  void* inside = nullptr;
  s.run([&] {
    inside = cuda::current_stream();
    ops::fill(ones, 1.0f);
    ops::fill(y, 1.0f);
    for (int i = 0; i < steps; ++i) {
      ops::gemm(y, false, two, false, tmp);  // tmp = 2y
      ops::add(tmp, ones, y);                // y = 2y + 1: the result depends on the order
    }
  });
  EXPECT_EQ(inside, s.native());
  EXPECT_EQ(cuda::current_stream(), nullptr);  // run() restores the thread's stream
  s.synchronize();

  float want = 1.0f;
  for (int i = 0; i < steps; ++i) want = 2.0f * want + 1.0f;  // 2^21 - 1, exact in fp32
  Tensor expected = Tensor::empty({n, n});
  ops::fill(expected, want);
  EXPECT_EQ(rel_err(y, expected), 0.0);
}

TEST(Streams, EventOrdersAConsumerStreamAfterAProducerStream) {
  TPX_REQUIRE_GPU();
  constexpr I big = 2048, n = 64;
  constexpr int adds = 50;
  const Tensor a = gpu_empty({big, big}), b = gpu_empty({big, big}), c = gpu_empty({big, big});
  ops::fill(a, 1e-3f);
  ops::fill(b, 1e-3f);
  const Tensor x_host = small_integers({n, n}, 7, 3), w_host = small_integers({n, n}, 5, 2);
  const Tensor x = on_gpu(x_host), w = on_gpu(w_host);
  const Tensor p = gpu_empty({n, n}), doubled = gpu_empty({n, n}), product = gpu_empty({n, n});
  ops::fill(p, -1.0f);  // what a consumer that did not wait would read
  ops::synchronize(Device::cuda);

  const Stream producer = Stream::create(Device::cuda), consumer = Stream::create(Device::cuda);
  Event produced(Device::cuda);
  producer.run([&] {
    for (int i = 0; i < 4; ++i) ops::gemm(a, false, b, false, c);  // keeps the producer busy
    ops::fill(p, 0.0f);
    for (int i = 0; i < adds; ++i) ops::accumulate(x, p);  // p = 50 x
  });
  produced.record(producer);
  produced.wait(consumer);
  consumer.run([&] {
    ops::add(p, p, doubled);                 // 100 x
    ops::gemm(p, false, w, false, product);  // 50 x·w
  });
  record_stream(p, consumer);
  record_stream(x, producer);
  consumer.synchronize();
  EXPECT_TRUE(produced.ready());
  EXPECT_NO_THROW(produced.synchronize());

  Tensor want_doubled = Tensor::empty({n, n}), want_product = Tensor::zeros({n, n});
  auto xs = x_host.f32(), ws = w_host.f32(), wd = want_doubled.f32(), wp = want_product.f32();
  for (std::size_t i = 0; i < xs.size(); ++i) wd[i] = 100.0f * xs[i];
  for (I r = 0; r < n; ++r)
    for (I k = 0; k < n; ++k)
      for (I col = 0; col < n; ++col)
        wp[static_cast<std::size_t>(r * n + col)] += 50.0f *
                                                     xs[static_cast<std::size_t>(r * n + k)] *
                                                     ws[static_cast<std::size_t>(k * n + col)];
  EXPECT_EQ(rel_err(doubled, want_doubled), 0.0);
  EXPECT_EQ(rel_err(product, want_product), 0.0);
  producer.synchronize();
}

// Every comm lane of the stages takes its work through run_after_compute: the lane must not read
// a tensor before the compute stream has written it. Stage 08's K/V all-gather once skipped the
// mark and gathered stale K/V on the GPU (the cpu, whose compute stream runs inline, cannot tell).
TEST(Streams, RunAfterComputeWaitsForTheComputeStreamsWrites) {
  TPX_REQUIRE_GPU();
  constexpr I n = I{1} << 16;
  const Tensor t = gpu_empty({n}), out = gpu_empty({n});
  ops::fill(t, 1.0f);  // the fill kernel loaded and the blocks allocated before the gate
  ops::fill(out, -1.0f);
  ops::synchronize(Device::cuda);
  const Stream lane = Stream::create(Device::cuda);
  Event done(Device::cuda);
  bool ran_early = true, timed_out = false;
  {
    const Stream compute(Device::cuda);
    HostGate gate(compute);  // the compute stream is held here
    ops::fill(t, 7.0f);      // written behind the gate
    done = run_after_compute(lane, {t, out}, [&] { ops::copy(t, out); });
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ran_early = done.ready();
    gate.open();
    done.synchronize();
    timed_out = gate.timed_out();
  }
  ASSERT_FALSE(timed_out);
  EXPECT_FALSE(ran_early) << "the lane's work finished while the compute stream was held";
  for (const float v : on_cpu(out).f32()) ASSERT_EQ(v, 7.0f);
}

// Stage 09's send and receive lanes on cuda: a host-staged transfer blocks the thread that runs
// it, so it runs on a host lane's own thread, issuing on the lane's cuda stream, while the calling
// thread goes on; the lane still waits for the compute stream's writes, and the compute stream
// for the lane's work.
TEST(Streams, HostLaneRunsBlockingWorkOnItsOwnThreadInTheStreamsOrder) {
  TPX_REQUIRE_GPU();
  constexpr I n = I{1} << 16;
  const Tensor t = gpu_empty({n}), out = gpu_empty({n}), doubled = gpu_empty({n});
  ops::fill(t, 1.0f);
  ops::fill(out, -1.0f);
  ops::add(out, out, doubled);  // every kernel loaded before the gate
  ops::synchronize(Device::cuda);
  const Stream lane = Stream::create_host_lane(Device::cuda);
  std::atomic<bool> release{false};
  std::thread::id ran_on;
  bool ready_while_held = true, timed_out = false;
  {
    const Stream compute(Device::cuda);
    HostGate gate(compute);
    ops::fill(t, 7.0f);  // written behind the gate
    const Event done = run_after_compute(lane, {t, out}, [&] {
      ran_on = std::this_thread::get_id();
      while (!release.load()) std::this_thread::yield();  // blocks the lane's thread only
      lane.synchronize();  // as MPI's staging does: the lane's cuda stream, not this task
      ops::copy(t, out);
    });
    ready_while_held = done.ready();  // this thread was not blocked by the lane's work
    gate.open();
    release = true;
    done.wait(compute);           // until the lane's thread has reached the mark
    ops::add(out, out, doubled);  // then on the compute stream, after the lane's copy
    ops::synchronize(Device::cuda);
    timed_out = gate.timed_out();
  }
  ASSERT_FALSE(timed_out);
  EXPECT_FALSE(ready_while_held);
  EXPECT_NE(ran_on, std::this_thread::get_id());
  for (const float v : on_cpu(doubled).f32()) ASSERT_EQ(v, 14.0f);
}

TEST(Allocator, FreeListsArePerStream) {
  TPX_REQUIRE_GPU();
  Allocator& a = allocator_for(Device::cuda);
  caching_allocator().release_cached();
  const Stream s = Stream::create(Device::cuda);
  void* p = nullptr;
  s.run([&] {
    p = a.allocate(3000);
    a.deallocate(p, 3000);  // cached for s
  });
  void* q = a.allocate(3000);  // the default stream does not get s's block
  EXPECT_NE(q, p);
  void* r = nullptr;
  s.run([&] { r = a.allocate(3000); });
  EXPECT_EQ(r, p);  // s does
  s.run([&] { a.deallocate(r, 3000); });
  a.deallocate(q, 3000);
}

TEST(Allocator, ExactModeAllocatesWhatIsAskedAndCachesNothing) {
  TPX_REQUIRE_GPU();
  // TPX_EXACT_ALLOC=1 is read when an allocator is made: a private one, so the process's
  // allocator keeps its cache.
  ::setenv("TPX_EXACT_ALLOC", "1", 1);
  cuda::CachingAllocator exact;
  ::unsetenv("TPX_EXACT_ALLOC");
  void* p = exact.allocate(1000);
  EXPECT_EQ(exact.reserved_bytes(), 1000u);  // not rounded up to a 512-byte class
  exact.deallocate(p, 1000);
  EXPECT_EQ(exact.reserved_bytes(), 0u);  // given back at once, not cached
  cuda::CachingAllocator cached;
  void* q = cached.allocate(1000);
  cached.deallocate(q, 1000);
  EXPECT_EQ(cached.reserved_bytes(), 1024u);  // the default: a 1024-byte class, kept
}

TEST(Allocator, RecordedBlockIsHeldUntilTheStreamHasPassedTheFree) {
  TPX_REQUIRE_GPU();
  Allocator& a = allocator_for(Device::cuda);
  cuda::CachingAllocator& cache = caching_allocator();
  cache.release_cached();
  constexpr std::size_t bytes = 5000;
  const Stream s = Stream::create(Device::cuda);
  void* p = a.allocate(bytes);
  void* spare = a.allocate(bytes);  // cached below, so that no cudaMalloc runs behind the gate
  a.deallocate(spare, bytes);
  const MemoryStats before = a.stats();
  const std::size_t reserved = cache.reserved_bytes();
  {
    HostGate gate(s);
    a.record_stream(p, s.native());
    a.record_stream(p, nullptr);  // the block's own stream: ignored
    a.deallocate(p, bytes);
    EXPECT_EQ(a.stats().current, before.current - bytes);  // no longer in use ...
    EXPECT_EQ(cache.reserved_bytes(), reserved);           // ... but still reserved
    void* q = a.allocate(bytes);
    EXPECT_NE(q, p);  // s has not passed the free
    EXPECT_EQ(q, spare);
    a.deallocate(q, bytes);
    gate.open();
    s.synchronize();
    EXPECT_FALSE(gate.timed_out());
  }
  void* r = a.allocate(bytes);  // the held block is back on the default stream's free list
  EXPECT_EQ(r, p);
  a.deallocate(r, bytes);
}

/// Frees a tensor read by a held-back stream and allocates one of the same size on the default
/// stream at once; returns whether the new tensor got the freed block, with `out` = what the
/// stream read once released.
struct ReuseResult {
  bool same_block = false;
  bool timed_out = false;
};
ReuseResult free_while_another_stream_reads(const Tensor& host, const Tensor& out, bool record) {
  caching_allocator().release_cached();
  const I n = host.numel();
  Tensor t = on_gpu(host);
  // A cached block of the size on the default stream (what the next allocation gets when t's
  // block is held back), and the fill kernel loaded: behind the gate nothing may need cudaMalloc
  // or a module load.
  ops::fill(gpu_empty({n}), 0.0f);
  void* const old = t.storage_ptr();
  const Stream s = Stream::create(Device::cuda);
  ReuseResult result;
  {
    HostGate gate(s);
    s.run([&] { ops::copy(t, out); });  // issued now, runs once the gate opens
    if (record) record_stream(t, s);
    t = Tensor();
    const Tensor u = gpu_empty({n});
    result.same_block = u.storage_ptr() == old;
    ops::fill(u, -7.0f);  // the new owner overwrites its block
    ops::synchronize(Device::cuda);
    gate.open();
    s.synchronize();
    result.timed_out = gate.timed_out();
  }
  return result;
}

TEST(Streams, RecordStreamKeepsAFreedTensorFromEarlyReuse) {
  TPX_REQUIRE_GPU();
  constexpr I n = I{1} << 16;
  const Tensor host = random_tensor({n}, 21);
  const Tensor out = gpu_empty({n});
  const ReuseResult r = free_while_another_stream_reads(host, out, /*record=*/true);
  EXPECT_FALSE(r.timed_out);
  EXPECT_FALSE(r.same_block);
  EXPECT_EQ(rel_err(out, host), 0.0);  // the stream read the original values
}

TEST(Streams, WithoutRecordStreamTheBlockIsReusedAtOnce) {
  TPX_REQUIRE_GPU();
  // The control for the test above: the same steps without record_stream() hand t's block to
  // the next allocation of its size (last in, first out), and the held-back stream reads the new
  // owner's values. So that test would fail if record_stream() were ignored.
  constexpr I n = I{1} << 16;
  const Tensor host = random_tensor({n}, 21);
  const Tensor out = gpu_empty({n});
  const ReuseResult r = free_while_another_stream_reads(host, out, /*record=*/false);
  EXPECT_FALSE(r.timed_out);
  EXPECT_TRUE(r.same_block);
  Tensor garbage = Tensor::empty({n});
  ops::fill(garbage, -7.0f);
  EXPECT_EQ(rel_err(out, garbage), 0.0);
}

TEST(Streams, ConcurrentGemmsOnTwoStreamsMatchSerialGemms) {
  TPX_REQUIRE_GPU();
  // Long k and small m, n: the shapes for which cuBLASLt splits k and reduces in its workspace,
  // and attention's batched GEMMs (cuBLAS); two different problems per shape, one per stream,
  // so that a shared workspace would mix their partial sums.
  struct Shape {
    I m, n, k;
  };
  const std::vector<Shape> shapes = {{64, 64, 16384}, {256, 128, 8192}, {96, 200, 4096}};
  constexpr I seq = 128, batch = 2, heads = 4, head_dim = 32, hidden = heads * head_dim;
  constexpr int iterations = 20;
  const Stream streams[2] = {Stream::create(Device::cuda), Stream::create(Device::cuda)};

  for (const DType compute : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(to_string(compute));
    struct Problem {
      std::vector<Tensor> a, b, want;
      Tensor q, k, v, want_out, want_probs;
    };
    Problem problems[2];
    std::uint32_t seed = 100;
    for (Problem& pr : problems) {
      for (const Shape& sh : shapes) {
        pr.a.push_back(on_gpu(random_tensor({sh.m, sh.k}, seed++)));
        pr.b.push_back(on_gpu(random_tensor({sh.k, sh.n}, seed++)));
        pr.want.push_back(gpu_empty({sh.m, sh.n}));
        ops::gemm(pr.a.back(), false, pr.b.back(), false, pr.want.back(), 1.0f, 0.0f, compute);
      }
      pr.q = on_gpu(random_tensor({seq, batch, hidden}, seed++));
      pr.k = on_gpu(random_tensor({seq, batch, hidden}, seed++));
      pr.v = on_gpu(random_tensor({seq, batch, hidden}, seed++));
      pr.want_out = gpu_empty({seq, batch, hidden});
      pr.want_probs = gpu_empty({batch, heads, seq, seq});
      ops::attention_forward(pr.q, pr.k, pr.v, heads, pr.want_out, pr.want_probs, compute);
    }
    ops::synchronize(Device::cuda);  // the serial results, and the operands ready for both streams

    struct Outputs {
      std::vector<Tensor> c, out;
    };
    Outputs outputs[2];
    for (int it = 0; it < iterations; ++it) {
      for (int si = 0; si < 2; ++si) {
        const Problem& pr = problems[si];
        Outputs& o = outputs[si];
        streams[si].run([&] {
          for (std::size_t i = 0; i < shapes.size(); ++i) {
            o.c.push_back(gpu_empty({shapes[i].m, shapes[i].n}));
            ops::gemm(pr.a[i], false, pr.b[i], false, o.c.back(), 1.0f, 0.0f, compute);
          }
          o.out.push_back(gpu_empty({seq, batch, hidden}));
          const Tensor probs = gpu_empty({batch, heads, seq, seq});  // freed on its own stream
          ops::attention_forward(pr.q, pr.k, pr.v, heads, o.out.back(), probs, compute);
        });
      }
    }
    for (const Stream& s : streams) s.synchronize();

    for (int si = 0; si < 2; ++si) {
      SCOPED_TRACE(testing::Message() << "stream " << si);
      for (int it = 0; it < iterations; ++it) {
        for (std::size_t i = 0; i < shapes.size(); ++i)
          EXPECT_LE(rel_err(outputs[si].c[static_cast<std::size_t>(it) * shapes.size() + i],
                            problems[si].want[i]),
                    1e-5)
              << "iteration " << it << " gemm " << i;
        EXPECT_LE(rel_err(outputs[si].out[static_cast<std::size_t>(it)], problems[si].want_out),
                  1e-5)
            << "iteration " << it << " attention";
      }
    }
  }
}

}  // namespace
}  // namespace tpx
