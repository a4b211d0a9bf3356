#pragma once
//! NVML's C ABI as lockstep::NvmlSampler (gpu_sampler.hpp) uses it: the types, and the table
//! of entry points it fills with dlsym.

namespace lockstep::detail {

// NVML's C ABI, declared here so no nvml.h is needed: nvmlReturn_t and the enums are ints,
// nvmlDevice_t an opaque pointer; the structs have NVML's documented layouts.
using nvml_return = int;
using nvml_device = struct nvml_device_opaque*;
struct nvml_utilization {
  unsigned int gpu, memory;
};
struct nvml_memory {
  unsigned long long total, free, used;
};
struct nvml_pci_info {  // nvmlPciInfo_t as nvmlDeviceGetPciInfo_v3 fills it
  char bus_id_legacy[16];
  unsigned int domain, bus, device, pci_device_id, pci_subsystem_id;
  char bus_id[32];
};
inline constexpr nvml_return nvml_success = 0;
inline constexpr int nvml_temperature_gpu = 0;

//! The NVML entry points lockstep calls, looked up with dlsym.
struct nvml_api {
  nvml_return (*init)() = nullptr;                                        // nvmlInit_v2
  nvml_return (*shutdown)() = nullptr;                                    // nvmlShutdown
  const char* (*error_string)(nvml_return) = nullptr;                     // nvmlErrorString
  nvml_return (*device_count)(unsigned int*) = nullptr;                   // nvmlDeviceGetCount_v2
  nvml_return (*by_index)(unsigned int, nvml_device*) = nullptr;          // nvmlDeviceGetHandleByIndex_v2
  nvml_return (*by_pci_bus_id)(const char*, nvml_device*) = nullptr;      // nvmlDeviceGetHandleByPciBusId_v2
  nvml_return (*utilization)(nvml_device, nvml_utilization*) = nullptr;   // nvmlDeviceGetUtilizationRates
  nvml_return (*memory)(nvml_device, nvml_memory*) = nullptr;             // nvmlDeviceGetMemoryInfo
  nvml_return (*temperature)(nvml_device, int, unsigned int*) = nullptr;  // nvmlDeviceGetTemperature
  nvml_return (*power)(nvml_device, unsigned int*) = nullptr;             // nvmlDeviceGetPowerUsage (mW)
  nvml_return (*name)(nvml_device, char*, unsigned int) = nullptr;        // nvmlDeviceGetName
  nvml_return (*pci_info)(nvml_device, nvml_pci_info*) = nullptr;         // nvmlDeviceGetPciInfo_v3
};

}  // namespace lockstep::detail
