// A minimal NVTX tool for tests/cpu/test_nvtx.cpp: NVTX loads it from NVTX_INJECTION64_PATH at
// the first NVTX call (as Nsight Systems' own library is loaded) and it records the domain
// calls — domain creation, push/pop, start/end — one line each, with the calling thread, for
// the test to read through lockstep_nvtx_events().
#include <nvtx3/nvToolsExt.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>

namespace {

std::mutex m;
std::string events;  // "thread\tkind\tname\tpayload\n" per call
std::string copy;    // what lockstep_nvtx_events() last returned
std::atomic<std::uint64_t> next_id{1};

std::string thread_name() {
  std::ostringstream s;
  s << std::hash<std::thread::id>{}(std::this_thread::get_id());
  return s.str();
}

void record(const char* kind, const nvtxEventAttributes_t* a, long long id = -1) {
  std::string name = "-", payload = "-";
  if (a != nullptr && a->messageType == NVTX_MESSAGE_TYPE_ASCII && a->message.ascii != nullptr) name = a->message.ascii;
  if (a != nullptr && a->payloadType == NVTX_PAYLOAD_TYPE_INT64) payload = std::to_string(a->payload.llValue);
  if (id >= 0) payload = std::to_string(id);
  std::lock_guard<std::mutex> lock(m);
  events += thread_name() + "\t" + kind + "\t" + name + "\t" + payload + "\n";
}

nvtxDomainHandle_t NVTX_API domain_create(const char* name) {
  {
    std::lock_guard<std::mutex> lock(m);
    events += thread_name() + "\tdomain\t" + (name ? name : "-") + "\t-\n";
  }
  static int handle = 0;
  return reinterpret_cast<nvtxDomainHandle_t>(&handle);
}
int NVTX_API push(nvtxDomainHandle_t, const nvtxEventAttributes_t* a) {
  record("push", a);
  return 0;
}
int NVTX_API pop(nvtxDomainHandle_t) {
  record("pop", nullptr);
  return 0;
}
nvtxRangeId_t NVTX_API start(nvtxDomainHandle_t, const nvtxEventAttributes_t* a) {
  const auto id = next_id.fetch_add(1);
  std::string name = a && a->message.ascii ? a->message.ascii : "-";
  std::lock_guard<std::mutex> lock(m);
  events += thread_name() + "\tstart\t" + name + "\t" + std::to_string(id) + "\n";
  return id;
}
void NVTX_API end(nvtxDomainHandle_t, nvtxRangeId_t id) { record("end", nullptr, static_cast<long long>(id)); }

bool set(NvtxFunctionTable table, unsigned size, unsigned slot, NvtxFunctionPointer fn) {
  if (table == nullptr || slot > size || table[slot] == nullptr) return false;  // size: the last index
  *table[slot] = fn;
  return true;
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get) {
  const auto* callbacks = static_cast<const NvtxExportTableCallbacks*>(get(NVTX_ETID_CALLBACKS));
  if (callbacks == nullptr) return 0;
  NvtxFunctionTable table = nullptr;
  unsigned size = 0;
  if (!callbacks->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &table, &size)) return 0;
  const bool ok =
      set(table, size, NVTX_CBID_CORE2_DomainCreateA, reinterpret_cast<NvtxFunctionPointer>(&domain_create)) &&
      set(table, size, NVTX_CBID_CORE2_DomainRangePushEx, reinterpret_cast<NvtxFunctionPointer>(&push)) &&
      set(table, size, NVTX_CBID_CORE2_DomainRangePop, reinterpret_cast<NvtxFunctionPointer>(&pop)) &&
      set(table, size, NVTX_CBID_CORE2_DomainRangeStartEx, reinterpret_cast<NvtxFunctionPointer>(&start)) &&
      set(table, size, NVTX_CBID_CORE2_DomainRangeEnd, reinterpret_cast<NvtxFunctionPointer>(&end));
  return ok ? 1 : 0;
}

//! Every call recorded so far, one line each: thread, kind, name, payload (or range id).
__attribute__((visibility("default"))) const char* lockstep_nvtx_events() {
  std::lock_guard<std::mutex> lock(m);
  copy = events;
  return copy.c_str();
}
}
