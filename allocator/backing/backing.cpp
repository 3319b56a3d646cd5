#include "allocator/backing/backing.h"

#include "allocator/errors.h"

namespace tus {

void Backing::release_chunk(PhysicalRange&, Chunk&) {
  TUS_THROW(InvalidArgument, "backing '" << name() << "' cannot pause memory");
}

void Backing::restore_chunk(PhysicalRange&, Chunk&) {
  TUS_THROW(InvalidArgument, "backing '" << name() << "' cannot resume memory");
}

}  // namespace tus
