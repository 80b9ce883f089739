// Page-locked ("pinned") host memory of the spyre device type.
#pragma once

#include <c10/core/Allocator.h>

namespace spyreccl::device {

// The allocator behind pin_memory() and torch.empty(..., pin_memory=True) while
// spyre is the accelerator (the hooks' getPinnedMemoryAllocator and the host
// allocator registered for PrivateUse1). Spyre memory is host memory, so a
// pinned block is an ordinary CPU block; what makes it "pinned" is that this
// allocator knows it (is_pinned_pointer), as a driver knows its page-locked
// ranges.
c10::Allocator* pinned_allocator();

// Whether `ptr` lies inside a live block of pinned_allocator(). Answers for
// interior pointers too (a view's data pointer), as cudaPointerGetAttributes
// does. Thread-safe.
bool is_pinned_pointer(const void* ptr);

}  // namespace spyreccl::device
