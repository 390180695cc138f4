// The gtest main of every flashport suite: re-seeds test_rng() per test and prints the run's
// base seed (FLASHPORT_TEST_SEED=<seed> reproduces it) and each failing test's seed.
#include <cstdio>

#include "test_util.hpp"

namespace {

class SeedListener : public ::testing::EmptyTestEventListener {
  void OnTestStart(const ::testing::TestInfo&) override {
    flashport::test::test_rng().seed(flashport::test::test_seed());
  }
  void OnTestEnd(const ::testing::TestInfo& info) override {
    if (info.result()->Failed())
      std::printf("[  SEED    ] %s.%s: FLASHPORT_TEST_SEED=%llu\n", info.test_suite_name(),
                  info.name(), static_cast<unsigned long long>(flashport::test::base_seed()));
  }
};

}  // namespace

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  std::printf("flashport tests: FLASHPORT_TEST_SEED=%llu\n",
              static_cast<unsigned long long>(flashport::test::base_seed()));
  ::testing::UnitTest::GetInstance()->listeners().Append(new SeedListener);
  return RUN_ALL_TESTS();
}
