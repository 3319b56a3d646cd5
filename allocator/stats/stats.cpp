#include "allocator/stats/stats.h"

namespace tus {

namespace {

void apply_to(ScopeStats& scope, const Footprint& before, const Footprint& after) {
#define TUS_APPLY_SHARE(name, doc) scope.name.change(after.name - before.name);
  TUS_FOOTPRINT_GAUGES(TUS_APPLY_SHARE)
#undef TUS_APPLY_SHARE
}

void reset_scope_peaks(ScopeStats& scope) {
#define TUS_RESET_PEAK(name, doc) scope.name.reset_peak();
  TUS_GAUGE_STATS(TUS_RESET_PEAK)
#undef TUS_RESET_PEAK
}

void add_scope(StatsDict& out, const std::string& scope_name, const ScopeStats& scope) {
#define TUS_ADD_GAUGE(name, doc)                                     \
  out[#name "." + scope_name + ".current"] = scope.name.current;     \
  out[#name "." + scope_name + ".peak"] = scope.name.peak;           \
  out[#name "." + scope_name + ".allocated"] = scope.name.allocated; \
  out[#name "." + scope_name + ".freed"] = scope.name.freed;
#define TUS_ADD_VALUE(name, doc) out[#name "." + scope_name] = scope.name;
  TUS_GAUGE_STATS(TUS_ADD_GAUGE)
  TUS_COUNTER_STATS(TUS_ADD_VALUE)
  TUS_TIMER_STATS(TUS_ADD_VALUE)
#undef TUS_ADD_GAUGE
#undef TUS_ADD_VALUE
}

constexpr const char* kDeviceStatKeys[] = {
#define TUS_DEVICE_STAT_KEY(id, key, doc) key,
    TUS_DEVICE_STATS(TUS_DEVICE_STAT_KEY)
#undef TUS_DEVICE_STAT_KEY
};

}  // namespace

void put_value(StatsDict& out, DeviceStat stat, StatValue value) {
  out[kDeviceStatKeys[static_cast<int>(stat)]] = value;
}

std::vector<StatDoc> stat_docs() {
  return {
#define TUS_DOC_GAUGE(name, doc) {#name, "gauge", doc},
#define TUS_DOC_COUNTER(name, doc) {#name, "counter", doc},
#define TUS_DOC_TIMER(name, doc) {#name, "timer", doc},
#define TUS_DOC_DEVICE(id, key, doc) {key, "device", doc},
      TUS_GAUGE_STATS(TUS_DOC_GAUGE) TUS_COUNTER_STATS(TUS_DOC_COUNTER)
          TUS_TIMER_STATS(TUS_DOC_TIMER) TUS_DEVICE_STATS(TUS_DOC_DEVICE)
#undef TUS_DOC_GAUGE
#undef TUS_DOC_COUNTER
#undef TUS_DOC_TIMER
#undef TUS_DOC_DEVICE
  };
}

void StatsBook::apply(Mode mode, const std::string& tag, const Footprint& before,
                      const Footprint& after) {
  for_scopes(mode, tag, [&](ScopeStats& scope) { apply_to(scope, before, after); });
}

void StatsBook::reset_peak() {
  reset_scope_peaks(all_);
  for (ScopeStats& scope : modes_) reset_scope_peaks(scope);
  for (auto& [tag, scope] : tags_) reset_scope_peaks(scope);
}

void StatsBook::add_to(StatsDict& out) const {
  add_scope(out, "all", all_);
  for (int mode = 0; mode < kNumModes; ++mode) {
    add_scope(out, mode_name(static_cast<Mode>(mode)), modes_[mode]);
  }
  for (const auto& [tag, scope] : tags_) add_scope(out, "tag:" + tag, scope);
}

}  // namespace tus
