// Lookup of the live block that holds an address, for registries of blocks keyed
// by start address (the spyre allocator's and the pinned allocator's).
#pragma once

#include <cstdint>
#include <iterator>

namespace spyreccl::device {

// The entry of `blocks` (an ordered map from start address) whose block
// [start, start + size_of(entry)) holds `address`, or blocks.end(). Answers for
// interior pointers too (a view's data pointer). The caller holds the map's lock.
template <class Map, class SizeOf>
typename Map::const_iterator find_block(const Map& blocks, std::uintptr_t address, SizeOf size_of) {
  auto it = blocks.upper_bound(address);
  if (it == blocks.begin()) {
    return blocks.end();
  }
  it = std::prev(it);
  return address - it->first < size_of(it->second) ? it : blocks.end();
}

}  // namespace spyreccl::device
