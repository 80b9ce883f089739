// peer_pipeline.cpp — see peer_pipeline.h.
#include "backend/peer_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <utility>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "backend/errors.h"
#include "backend/staging.h"
#include "backend/tensor_translation.h"

namespace spyreccl_torch {
namespace {

// Message 0 starts with this header; 64 bytes keep the data after it aligned for every dtype.
constexpr int64_t kHeaderBytes = 64;
constexpr uint64_t kHeaderMagic = 0x7370797265703270ULL;  // "spyrep2p"

struct Header {
  uint64_t magic;
  uint64_t bytes;      // the whole message's data bytes
  int64_t numel;       // its tensor elements
  int32_t scalarType;  // the sender's at::ScalarType (named in the receiver's error)
  int32_t dtype;       // the core dtype the data travels as (what must match, as in the core)
};
static_assert(sizeof(Header) <= kHeaderBytes, "the header must fit its reserved bytes");

// How long the sender waits for a chunk's copy before it progresses the communicator again:
// short against a chunk's transfer, long enough not to spin (the copy thread needs the CPU
// on machines where the copies are memcpys).
constexpr auto kCopyWaitSlice = std::chrono::microseconds(50);

// The user's tensor as one dense run of elements on its device (a dense device copy of a
// strided input, a dense device temporary for a strided output: see finish()).
at::Tensor denseDeviceRun(const at::Tensor& user, bool sends) {
  if (user.is_contiguous()) {
    return user.view({-1});
  }
  return (sends ? user.contiguous() : at::empty(user.sizes(), user.options())).view({-1});
}

}  // namespace

bool pipelinedPeerStep(const Step& step) {
  return step.peerCall && !step.buffers.empty() && step.buffers[0].pipelined();
}

PeerPipeline::PeerPipeline(const Step& step, Communicator& comm, std::string what)
    : call_(*step.peerCall),
      comm_(comm),
      what_(std::move(what)),
      trace_(step.trace),
      user_(step.buffers.at(0).userTensor()),
      dtype_(step.buffers.at(0).dtype()),
      units_(step.buffers.at(0).units()),
      numel_(user_.numel()),
      step_(stagingChunkElements(numel_, user_.element_size())),
      sends_(call_.kind == PeerCall::Kind::kSend),
      peer_(call_.peer) {
  const size_t n = static_cast<size_t>((numel_ + step_ - 1) / step_);
  requests_.assign(n, nullptr);
  copies_.resize(n);
}

PeerPipeline::~PeerPipeline() { waitCopies(); }

void PeerPipeline::waitCopies() noexcept {
  for (auto& copy : copies_) {
    if (copy.valid()) {
      copy.wait();
    }
  }
}

int64_t PeerPipeline::chunkLength(size_t k) const {
  return std::min(step_, numel_ - chunkBegin(k));
}

std::string PeerPipeline::describeChunk(size_t k) const {
  // The send/recv call's one tensor argument is always 'tensors[0]'.
  std::string text = what_ + " of 'tensors[0]' (" + std::to_string(numel_) + " elements of " +
                     dtypeName(user_.scalar_type()) + "), chunk " + std::to_string(k + 1) + " of " +
                     std::to_string(chunks()) + " of the staged pipeline";
  if (k == 0) {
    // The core names this message's size in bytes, which the user's tensor does not show.
    text += " (sent as bytes: a " + std::to_string(kHeaderBytes) + "-byte header and " +
            std::to_string(chunkLength(0) * user_.element_size()) + " bytes of data)";
  }
  return text;
}

void PeerPipeline::post() {
  device_ = denseDeviceRun(user_, sends_);
  const int64_t dataBytes = numel_ * user_.element_size();
  host_ = acquireHostBuffer({kHeaderBytes + dataBytes}, at::kByte);
  hostData_ = host_.narrow(0, kHeaderBytes, dataBytes).view(user_.scalar_type());
  if (sends_) {
    postSends();
  } else if (call_.kind == PeerCall::Kind::kRecvAnySource) {
    receiveFirstFromAnySource();
  } else {
    postReceives(0);
  }
}

void PeerPipeline::writeHeader() {
  Header header{};
  header.magic = kHeaderMagic;
  header.bytes = static_cast<uint64_t>(numel_ * user_.element_size());
  header.numel = numel_;
  header.scalarType = static_cast<int32_t>(user_.scalar_type());
  header.dtype = static_cast<int32_t>(dtype_);
  std::memcpy(host_.data_ptr(), &header, sizeof(header));
}

void PeerPipeline::checkHeader() {
  Header header{};
  std::memcpy(&header, host_.data_ptr(), sizeof(header));
  const auto bytes = static_cast<uint64_t>(numel_ * user_.element_size());
  if (header.magic == kHeaderMagic && header.bytes == bytes &&
      header.dtype == static_cast<int32_t>(dtype_)) {
    return;
  }
  std::string sent = "a message that is not a staged send of spyreccl";
  if (header.magic == kHeaderMagic) {
    // Named only when it is one (the header comes from another process).
    const bool known = header.scalarType >= 0 &&
                       header.scalarType < static_cast<int32_t>(at::ScalarType::NumOptions);
    sent = std::to_string(header.numel) + " elements of " +
           (known ? dtypeName(static_cast<at::ScalarType>(header.scalarType))
                  : "dtype #" + std::to_string(header.scalarType)) +
           " (" + std::to_string(header.bytes) + " bytes)";
  }
  const std::string message = "spyreccl " + what_ + ": argument 'tensors[0]' holds " +
                              std::to_string(numel_) + " elements of " +
                              dtypeName(user_.scalar_type()) + " (" + std::to_string(bytes) +
                              " bytes), but rank " + std::to_string(peer_) + " sent " + sent +
                              "; a receive must match its send's size and dtype";
  // Whatever is still on its way from the peer (the sender's other chunks, or this rank's
  // posted receives' matches) would be taken for later messages: the pair is out of step,
  // as after the core's own mismatch, which also leaves the communicator failed.
  comm_.abort(message);
  std::rethrow_exception(makeDistBackendError(message));
}

void PeerPipeline::abortPosted(const std::string& reason) {
  for (const spyrecclRequest_t request : requests_) {
    if (request != nullptr) {
      comm_.abort(reason);
      return;
    }
  }
}

void PeerPipeline::submitCopy(size_t k, bool toHost) {
  const int64_t begin = chunkBegin(k);
  const int64_t length = chunkLength(k);
  at::Tensor host = hostData_.narrow(0, begin, length);
  at::Tensor device = device_.narrow(0, begin, length);
  copies_[k] = submitStagingCopy(tls_, std::move(host), std::move(device), toHost);
}

void PeerPipeline::postMessage(size_t k) {
  const int64_t length = chunkLength(k);
  // Message 0: the header and chunk 0, as bytes; message k: chunk k in the core dtype.
  void* data = k == 0 ? host_.data_ptr() : hostData_.narrow(0, chunkBegin(k), length).data_ptr();
  const size_t count = k == 0 ? static_cast<size_t>(kHeaderBytes + length * user_.element_size())
                              : static_cast<size_t>(length * units_);
  const spyrecclDataType_t dtype = k == 0 ? spyrecclUint8 : dtype_;
  const spyrecclResult_t result =
      sends_ ? spyrecclIsend(data, count, dtype, peer_, call_.tag, comm_.get(), &requests_[k])
             : spyrecclIrecv(data, count, dtype, peer_, call_.tag, comm_.get(), &requests_[k]);
  if (result != spyrecclSuccess) {
    requests_[k] = nullptr;
    throwCoreError(result, comm_.get(), describeChunk(k));
  }
}

void PeerPipeline::postSends() {
  writeHeader();
  for (size_t k = 0; k < chunks(); ++k) {
    submitCopy(k, /*toHost=*/true);
  }
  try {
    for (size_t k = 0; k < chunks(); ++k) {
      // While the copy thread brings chunk k in, the core moves the chunks posted before it.
      while (copies_[k].wait_for(kCopyWaitSlice) != std::future_status::ready) {
        (void)spyrecclCommPoll(comm_.get(), 0, nullptr);
      }
      copies_[k].get();
      postMessage(k);
    }
  } catch (const std::exception& e) {
    // A chunk that cannot be posted leaves the peer waiting for it behind the ones posted.
    abortPosted("spyreccl " + describeChunk(0) + " failed part-way: " + e.what());
    throw;
  }
}

void PeerPipeline::postReceives(size_t first) {
  try {
    for (size_t k = first; k < chunks(); ++k) {
      postMessage(k);
    }
  } catch (const std::exception& e) {
    abortPosted("spyreccl " + describeChunk(0) + " failed part-way: " + e.what());
    throw;
  }
}

void PeerPipeline::receiveFirstFromAnySource() {
  int source = -1;
  const size_t firstBytes =
      static_cast<size_t>(kHeaderBytes + chunkLength(0) * user_.element_size());
  checkCore(spyrecclRecvAnySource(host_.data_ptr(), firstBytes, spyrecclUint8, call_.tag, &source,
                                  comm_.get()),
            comm_.get(), describeChunk(0));
  peer_ = source;
  if (call_.source) {
    *call_.source = source;
  }
  flight::setPeer(trace_, source);  // the recorded receive names its sender now
  what_ += " (sent by rank " + std::to_string(source) + ")";
  completed_ = 1;
  checkHeader();
  submitCopy(0, /*toHost=*/false);
  postReceives(1);
}

bool PeerPipeline::test(size_t k) {
  if (requests_[k] == nullptr) {
    return true;
  }
  return testPosted(requests_[k], comm_.get(), [&] { return describeChunk(k); });
}

bool PeerPipeline::poll() {
  // A pair's messages complete in posting order: test them in that order.
  while (completed_ < chunks() && test(completed_)) {
    if (!sends_) {
      if (completed_ == 0) {
        checkHeader();
      }
      // Back to the device while the core receives the next chunks.
      submitCopy(completed_, /*toHost=*/false);
    }
    ++completed_;
  }
  if (completed_ < chunks()) {
    return false;
  }
  if (!sends_) {
    for (auto& copy : copies_) {
      copy.get();  // a host -> device copy, never the peer: a bounded wait
    }
    if (!user_.is_contiguous()) {
      user_.copy_(device_.view(user_.sizes()));
    }
  }
  countPipeline(chunks());
  return true;
}

}  // namespace spyreccl_torch
