// StatsBook: the statistics of one Allocator, per scope ("all", each mode, each tag), flattened
// to PyTorch-style keys: "<name>.<scope>.<field>" for gauges, "<name>.<scope>" for counters and
// timers, where scope is "all", a mode name ("vmm", "device") or "tag:<tag>".
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "allocator/stats/stat_list.h"
#include "allocator/types.h"

namespace tus {

struct Gauge {
  std::int64_t current = 0;
  std::int64_t peak = 0;
  std::int64_t allocated = 0;
  std::int64_t freed = 0;

  void change(std::int64_t delta) {
    current += delta;
    if (delta > 0) allocated += delta;
    if (delta < 0) freed -= delta;
    if (current > peak) peak = current;
  }
  void reset_peak() { peak = current; }
};

struct ScopeStats {
#define TUS_DECLARE_GAUGE(name, doc) Gauge name;
#define TUS_DECLARE_COUNTER(name, doc) std::int64_t name = 0;
#define TUS_DECLARE_TIMER(name, doc) double name = 0.0;
  TUS_GAUGE_STATS(TUS_DECLARE_GAUGE)
  TUS_COUNTER_STATS(TUS_DECLARE_COUNTER)
  TUS_TIMER_STATS(TUS_DECLARE_TIMER)
#undef TUS_DECLARE_GAUGE
#undef TUS_DECLARE_COUNTER
#undef TUS_DECLARE_TIMER
};

// What one segment contributes to the footprint gauges, a field per gauge (stat_list.h); the
// Allocator takes one before and one after each change to a segment and applies the difference
// (FootprintChange in residency/segment_footprint.h), so the stats are derived from segment state.
struct Footprint {
#define TUS_DECLARE_SHARE(name, doc) std::int64_t name = 0;
  TUS_FOOTPRINT_GAUGES(TUS_DECLARE_SHARE)
#undef TUS_DECLARE_SHARE
};

using StatValue = std::variant<std::int64_t, double>;
using StatsDict = std::map<std::string, StatValue>;

// A device-wide key of TUS_DEVICE_STATS: code names a value by its enumerator, and only
// put() turns it into the dict's key, so a key is spelled once.
enum class DeviceStat {
#define TUS_DECLARE_DEVICE_STAT(id, key, doc) id,
  TUS_DEVICE_STATS(TUS_DECLARE_DEVICE_STAT)
#undef TUS_DECLARE_DEVICE_STAT
};

void put_value(StatsDict& out, DeviceStat stat, StatValue value);
// Any count, size or flag (as an integer) or a number of seconds (as a double).
template <typename Number>
void put(StatsDict& out, DeviceStat stat, Number value) {
  static_assert(std::is_arithmetic_v<Number>, "a statistic is a number");
  if constexpr (std::is_floating_point_v<Number>) {
    put_value(out, stat, static_cast<double>(value));
  } else {
    put_value(out, stat, static_cast<std::int64_t>(value));
  }
}

// Every key family and device key with its documentation, for the Python module's stat_docs():
// (key, kind, doc); kind is "gauge", "counter", "timer" (per scope) or "device".
struct StatDoc {
  const char* key;
  const char* kind;
  const char* doc;
};
std::vector<StatDoc> stat_docs();

class StatsBook {
 public:
  // Applies `after - before` to the gauges of "all", `mode` and `tag`.
  void apply(Mode mode, const std::string& tag, const Footprint& before, const Footprint& after);
  // Calls `update(ScopeStats&)` for "all", `mode` and `tag`.
  template <typename Update>
  void for_scopes(Mode mode, const std::string& tag, Update update) {
    update(all_);
    update(modes_[static_cast<int>(mode)]);
    update(tags_[tag]);
  }
  const ScopeStats& all() const { return all_; }
  const ScopeStats& mode(Mode mode) const { return modes_[static_cast<int>(mode)]; }
  void reset_peak();
  void add_to(StatsDict& out) const;

 private:
  ScopeStats all_;
  std::array<ScopeStats, kNumModes> modes_;
  std::map<std::string, ScopeStats> tags_;
};

}  // namespace tus
