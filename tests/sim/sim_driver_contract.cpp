// Drives SimDriver's VMM calls directly, which _C does not expose (map, unmap, create_physical,
// release_physical, free_address, mem_alloc), so test_sim_driver.py can check the mapping rules
// of Note [Simulated VMM]. Built by that test against allocator/driver/sim_driver.cpp.
//
// Each step prints one line: "<step> ok [value]" or "<step> <ErrorType> <code> <message>", where
// the type is OutOfMemory, CudaError or InvalidArgument. The Python test asserts on the lines.
#include <iostream>
#include <string>

#include "allocator/driver/sim_driver.h"
#include "allocator/errors.h"

namespace {

using tus::kMiB;

template <typename Step>
void run(const std::string& name, Step step) {
  try {
    const std::string value = step();
    std::cout << name << " ok" << (value.empty() ? "" : " " + value) << "\n";
  } catch (const tus::OutOfMemory& error) {
    std::cout << name << " OutOfMemory 2 " << error.what() << "\n";
  } catch (const tus::CudaError& error) {
    std::cout << name << " CudaError " << error.code() << " " << error.what() << "\n";
  } catch (const tus::InvalidArgument& error) {
    std::cout << name << " InvalidArgument 0 " << error.what() << "\n";
  }
}

}  // namespace

int main() {
  tus::SimDriver driver(16 * kMiB, 1, 2 * kMiB);
  const tus::DevicePtr base = driver.reserve_address(0, 8 * kMiB);
  const tus::DevicePtr other = driver.reserve_address(0, 4 * kMiB);
  const tus::PhysHandle two = driver.create_physical(0, 2 * kMiB);
  const tus::PhysHandle four = driver.create_physical(0, 4 * kMiB);
  const tus::PhysHandle extra = driver.create_physical(0, 4 * kMiB);
  const auto used = [&] { return std::to_string(driver.used_bytes(0)); };

  run("reserve_alignment", [&] { return std::to_string((base | other) % (2 * kMiB)); });
  run("reserve_unaligned_size", [&] { return std::to_string(driver.reserve_address(0, kMiB)); });
  run("create_unaligned_size", [&] { return std::to_string(driver.create_physical(0, kMiB)); });
  run("used_after_create", [&] { return used(); });
  run("map_outside_reservation", [&] {
    driver.map(0, base + 64 * kMiB * 1024, 2 * kMiB, two);
    return std::string();
  });
  run("map_past_reservation_end", [&] {
    driver.map(0, base + 6 * kMiB, 4 * kMiB, four);
    return std::string();
  });
  run("map_across_two_reservations", [&] {
    driver.map(0, other - 2 * kMiB, 4 * kMiB, four);
    return std::string();
  });
  run("map_size_mismatch", [&] {
    driver.map(0, base, 4 * kMiB, two);
    return std::string();
  });
  run("map_first", [&] {
    driver.map(0, base + 2 * kMiB, 4 * kMiB, four);
    return std::string();
  });
  run("map_inside_mapping", [&] {
    driver.map(0, base + 4 * kMiB, 2 * kMiB, two);
    return std::string();
  });
  run("map_overlapping_next", [&] {
    driver.map(0, base, 4 * kMiB, extra);
    return std::string();
  });
  run("map_adjacent", [&] {
    driver.map(0, base, 2 * kMiB, two);
    return std::string();
  });
  run("unmap_wrong_size", [&] {
    driver.unmap(0, base + 2 * kMiB, 2 * kMiB);
    return std::string();
  });
  run("unmap_inside_mapping", [&] {
    driver.unmap(0, base + 4 * kMiB, 2 * kMiB);
    return std::string();
  });
  run("unmap_unmapped", [&] {
    driver.unmap(0, base + 6 * kMiB, 2 * kMiB);
    return std::string();
  });
  run("free_address_with_mappings", [&] {
    driver.free_address(0, base, 8 * kMiB);
    return std::string();
  });
  run("mapped_ranges", [&] { return std::to_string(driver.mapped_ranges()); });
  run("release_while_mapped", [&] {
    driver.release_physical(0, four);
    return used();
  });
  run("release_twice", [&] {
    driver.release_physical(0, four);
    return std::string();
  });
  run("unmap_released", [&] {
    driver.unmap(0, base + 2 * kMiB, 4 * kMiB);
    return used();
  });
  run("unmap_then_release", [&] {
    driver.unmap(0, base, 2 * kMiB);
    driver.release_physical(0, two);
    return used();
  });
  run("map_released_handle", [&] {
    driver.map(0, base, 2 * kMiB, two);
    return std::string();
  });
  run("release_unmapped", [&] {
    driver.release_physical(0, extra);
    return used();
  });
  run("free_address", [&] {
    driver.free_address(0, base, 8 * kMiB);
    driver.free_address(0, other, 4 * kMiB);
    return std::to_string(driver.mapped_ranges());
  });
  run("create_past_capacity", [&] {
    return std::to_string(driver.create_physical(0, 16 * kMiB + 2 * kMiB));
  });
  run("mem_alloc_past_capacity", [&] {
    return std::to_string(driver.mem_alloc(0, 32 * kMiB));
  });
  run("mem_alloc_and_free", [&] {
    const tus::DevicePtr plain = driver.mem_alloc(0, 5000);
    const std::string during = used();
    driver.mem_free(0, plain);
    return during + " " + used();
  });
  run("bad_device", [&] { return std::to_string(driver.create_physical(1, 2 * kMiB)); });
  return 0;
}
