#include "nvtx.h"

#include <nvtx3/nvToolsExt.h>

namespace tpx::cuda {
namespace {

struct TpxDomain {
  static constexpr const char* name = "tpx";
};

nvtxDomainHandle_t domain() {
  static const nvtxDomainHandle_t d = nvtxDomainCreateA(TpxDomain::name);
  return d;
}

}  // namespace

void nvtx_push(const char* name) {
  nvtxEventAttributes_t attr{};
  attr.version = NVTX_VERSION;
  attr.size = NVTX_EVENT_ATTRIB_STRUCT_SIZE;
  attr.messageType = NVTX_MESSAGE_TYPE_ASCII;
  attr.message.ascii = name;
  nvtxDomainRangePushEx(domain(), &attr);
}

void nvtx_pop() {
  nvtxDomainRangePop(domain());
}

}  // namespace tpx::cuda
