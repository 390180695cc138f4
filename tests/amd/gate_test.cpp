// The HIP backend's device gate (src/gpu/amd/amd_gate.hpp): which devices may run the AMD kernels of
// a build, from the device's gcnArchName, wave size and LDS, and the reason given otherwise.
#include <gtest/gtest.h>

#include "gpu/amd/amd_gate.hpp"

namespace amd = flashport::gpu::amd;

namespace {
constexpr const char* kBuilt = "gfx90a,gfx942,gfx1100,gfx1201";
}

TEST(AmdGate, BuiltTargetsPass) {
  EXPECT_EQ(amd::device_refusal("gfx942:sramecc+:xnack-", 64, 65536, 52224, kBuilt), "");
  EXPECT_EQ(amd::device_refusal("gfx90a:sramecc+:xnack-", 64, 65536, 52224, kBuilt), "");
  EXPECT_EQ(amd::device_refusal("gfx1100", 32, 65536, 52224, kBuilt), "");
  EXPECT_EQ(amd::device_refusal("gfx1201", 32, 65536, 27648, kBuilt), "");
}

TEST(AmdGate, TargetNotBuiltNamesDeviceAndList) {
  const std::string why = amd::device_refusal("gfx1101", 32, 65536, 27648, kBuilt);
  EXPECT_NE(why.find("gfx1101"), std::string::npos) << why;
  EXPECT_NE(why.find(kBuilt), std::string::npos) << why;
  EXPECT_NE(why.find("FLASHPORT_HIP_ARCHS"), std::string::npos) << why;
  EXPECT_NE(amd::device_refusal("gfx940", 64, 65536, 27648, kBuilt), "");
  EXPECT_NE(amd::device_refusal("gfx906", 64, 65536, 27648, kBuilt), "");
}

TEST(AmdGate, NotAnAmdTarget) {
  EXPECT_NE(amd::device_refusal("", 64, 65536, 0, kBuilt), "");
  EXPECT_NE(amd::device_refusal(nullptr, 64, 65536, 0, kBuilt), "");
  EXPECT_NE(amd::device_refusal("sm_90", 32, 65536, 0, kBuilt).find("not an AMD gfx target"), std::string::npos);
}

TEST(AmdGate, WaveSizeMismatch) {
  const std::string why = amd::device_refusal("gfx1100", 64, 65536, 27648, kBuilt);
  EXPECT_NE(why.find("wave64"), std::string::npos) << why;
  EXPECT_NE(why.find("wave32"), std::string::npos) << why;
}

TEST(AmdGate, LdsBudget) {
  // The smaller of the device's report and the per-target workgroup limit applies.
  const std::string why = amd::device_refusal("gfx942", 64, 32768, 52224, kBuilt);
  EXPECT_NE(why.find("52224"), std::string::npos) << why;
  EXPECT_NE(why.find("32768"), std::string::npos) << why;
  EXPECT_NE(amd::device_refusal("gfx942", 64, 1 << 20, 70000, kBuilt), "");  // over 64 KiB
  EXPECT_EQ(amd::device_refusal("gfx942", 64, 1 << 20, 65536, kBuilt), "");
}
