// Minimal blocking clients for Redis (RESP: SET/GET) and memcached (text protocol: set/get), so
// gkv-bench can drive the peers with exactly the same workload, concurrency and measurement as
// gkv. One TCP connection per object; not thread-safe (one per requester).
#pragma once

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <string>
#include <string_view>

#include "gkv/status.h"

namespace gkv::bench {

class PeerConnection {
 public:
  enum class Protocol { kRedis, kMemcached };

  static Result<std::unique_ptr<PeerConnection>> Connect(Protocol p, const std::string& host,
                                                         uint16_t port) {
    addrinfo hints{}, *res = nullptr;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) {
      return Status::InvalidArgument("cannot resolve " + host);
    }
    int fd = socket(res->ai_family, SOCK_STREAM, 0);
    int rc = fd < 0 ? -1 : connect(fd, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    if (rc != 0) {
      if (fd >= 0) close(fd);
      return Status::Unavailable("cannot connect to " + host + ":" + std::to_string(port));
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return std::unique_ptr<PeerConnection>(new PeerConnection(p, fd));
  }
  ~PeerConnection() { close(fd_); }

  Status Set(std::string_view key, std::string_view value) {
    std::string head;
    if (p_ == Protocol::kRedis) {
      head = "*3\r\n$3\r\nSET\r\n$" + std::to_string(key.size()) + "\r\n" + std::string(key) +
             "\r\n$" + std::to_string(value.size()) + "\r\n";
    } else {
      head = "set " + std::string(key) + " 0 0 " + std::to_string(value.size()) + "\r\n";
    }
    GKV_RETURN_IF_ERROR(Write(head.data(), head.size()));
    GKV_RETURN_IF_ERROR(Write(value.data(), value.size()));
    GKV_RETURN_IF_ERROR(Write("\r\n", 2));
    std::string line;
    GKV_RETURN_IF_ERROR(ReadLine(&line));
    if (line == "+OK" || line == "STORED") return Status::OK();
    return Status::IOError("peer refused the set: " + line);
  }

  // Returns the value size (NotFound on a miss). InvalidArgument if it exceeds `capacity`.
  Result<size_t> Get(std::string_view key, char* buf, size_t capacity) {
    std::string req = p_ == Protocol::kRedis ? "*2\r\n$3\r\nGET\r\n$" + std::to_string(key.size()) +
                                                   "\r\n" + std::string(key) + "\r\n"
                                             : "get " + std::string(key) + "\r\n";
    GKV_RETURN_IF_ERROR(Write(req.data(), req.size()));
    std::string line;
    GKV_RETURN_IF_ERROR(ReadLine(&line));
    size_t size = 0;
    if (p_ == Protocol::kRedis) {
      if (line == "$-1") return Status::NotFound("miss");
      if (line.empty() || line[0] != '$') return Status::IOError("unexpected reply: " + line);
      size = std::stoull(line.substr(1));
    } else {
      if (line == "END") return Status::NotFound("miss");
      // VALUE <key> <flags> <bytes>
      auto last = line.rfind(' ');
      if (line.rfind("VALUE ", 0) != 0 || last == std::string::npos) {
        return Status::IOError("unexpected reply: " + line);
      }
      size = std::stoull(line.substr(last + 1));
    }
    if (size > capacity) return Status::InvalidArgument("value larger than the buffer");
    GKV_RETURN_IF_ERROR(ReadExact(buf, size));
    char crlf[2];
    GKV_RETURN_IF_ERROR(ReadExact(crlf, 2));
    if (p_ == Protocol::kMemcached) {
      GKV_RETURN_IF_ERROR(ReadLine(&line));  // END
    }
    return size;
  }

 private:
  PeerConnection(Protocol p, int fd) : p_(p), fd_(fd) {}

  Status Write(const void* data, size_t n) {
    const char* p = static_cast<const char*>(data);
    while (n > 0) {
      ssize_t w = send(fd_, p, n, MSG_NOSIGNAL);
      if (w <= 0) return Status::Unavailable("peer connection closed");
      p += w;
      n -= w;
    }
    return Status::OK();
  }
  // Buffered reads.
  Status Fill() {
    if (pos_ < len_) return Status::OK();
    ssize_t r = recv(fd_, rbuf_, sizeof rbuf_, 0);
    if (r <= 0) return Status::Unavailable("peer connection closed");
    pos_ = 0;
    len_ = static_cast<size_t>(r);
    return Status::OK();
  }
  Status ReadLine(std::string* line) {
    line->clear();
    for (;;) {
      GKV_RETURN_IF_ERROR(Fill());
      char c = rbuf_[pos_++];
      if (c == '\n') {
        if (!line->empty() && line->back() == '\r') line->pop_back();
        return Status::OK();
      }
      line->push_back(c);
    }
  }
  Status ReadExact(char* out, size_t n) {
    while (n > 0) {
      if (pos_ < len_) {
        size_t take = std::min(n, len_ - pos_);
        std::memcpy(out, rbuf_ + pos_, take);
        pos_ += take;
        out += take;
        n -= take;
        continue;
      }
      if (n >= sizeof rbuf_) {  // large values: straight into the caller's buffer
        ssize_t r = recv(fd_, out, n, 0);
        if (r <= 0) return Status::Unavailable("peer connection closed");
        out += r;
        n -= r;
        continue;
      }
      GKV_RETURN_IF_ERROR(Fill());
    }
    return Status::OK();
  }

  Protocol p_;
  int fd_;
  char rbuf_[64 * 1024];
  size_t pos_ = 0, len_ = 0;
};

}  // namespace gkv::bench
