#include "config.hpp"

#include <cstdlib>
#include <cstring>

namespace flashport {
namespace {

bool flag_on(const char* v) { return v && *v && std::strcmp(v, "0") != 0; }
bool flag_off(const char* v) { return v && v[0] == '0'; }
std::string str_or_empty(const char* v) { return v ? v : ""; }

RuntimeConfig read_environment() {
  RuntimeConfig c;
  c.log = flag_on(std::getenv("FLASHPORT_LOG"));
  c.backend = str_or_empty(std::getenv("FLASHPORT_BACKEND"));
  if (const char* v = std::getenv("FLASHPORT_NUM_THREADS")) c.num_threads = std::atoi(v);
  c.cpu_isa = str_or_empty(std::getenv("FLASHPORT_CPU_ISA"));
  c.hopper_fwd = !flag_off(std::getenv("FLASHPORT_HOPPER_FWD"));
  c.hopper_bwd = !flag_off(std::getenv("FLASHPORT_HOPPER_BWD"));
  return c;
}

// Replaced only by reload_runtime_config (tests); readers hold a reference to the current one.
RuntimeConfig& cached() {
  static RuntimeConfig c = read_environment();
  return c;
}

}  // namespace

const RuntimeConfig& runtime_config() { return cached(); }

void reload_runtime_config() { cached() = read_environment(); }

}  // namespace flashport
