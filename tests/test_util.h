// Shared helpers for gkv tests: temporary directories and the replayable seed.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <string>

#include "gkv/random.h"

namespace gkv::testing {

// A fresh directory under $TMPDIR, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "gkv-test-XXXXXX").string();
    char* p = mkdtemp(tmpl.data());
    EXPECT_NE(p, nullptr) << "mkdtemp failed";
    path_ = tmpl;
  }
  // GKV_KEEP_FAILED_TEST_DIRS=1 keeps the directory (node logs, disk tiers) of a test that had
  // failed by the time the directory went.
  ~TempDir() {
    const char* keep = std::getenv("GKV_KEEP_FAILED_TEST_DIRS");
    if (keep && std::strcmp(keep, "1") == 0 && ::testing::Test::HasFailure()) {
      std::cerr << "kept " << path_ << " (the test failed)\n";
      return;
    }
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string Sub(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The seed for this test: GKV_SEED if set, else a fixed default. Printed so a failure replays.
inline uint64_t TestSeed() {
  uint64_t seed = Random::SeedFromEnv(20261202);
  ::testing::Test::RecordProperty("seed", std::to_string(seed));
  return seed;
}

}  // namespace gkv::testing
