// Message: builds error and log text without iostreams.
//
// Streams format numbers through the C++ locale machinery. On the lent H200 (Ubuntu 24.04, GCC
// 13.3) the module built there segfaulted inside the first `stream << int` (seen in a backtrace
// under std::basic_ostream::_M_insert<long>), while string-only messages worked; the cause was not
// pinned down. Error paths must never be what crashes, so text is built from std::string and
// std::to_string only.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <type_traits>

namespace tus {

class Message {
 public:
  Message& operator<<(const std::string& text) {
    text_ += text;
    return *this;
  }
  Message& operator<<(const char* text) {
    text_ += text == nullptr ? "(null)" : text;
    return *this;
  }
  Message& operator<<(char character) {
    text_ += character;
    return *this;
  }
  Message& operator<<(bool value) {
    text_ += value ? "true" : "false";
    return *this;
  }
  template <typename Integer, typename = std::enable_if_t<std::is_integral_v<Integer> &&
                                                          !std::is_same_v<Integer, char> &&
                                                          !std::is_same_v<Integer, bool>>>
  Message& operator<<(Integer value) {
    text_ += std::to_string(value);
    return *this;
  }
  Message& operator<<(double value) {
    char buffer[32];
    std::snprintf(buffer, sizeof(buffer), "%g", value);
    text_ += buffer;
    return *this;
  }

  const std::string& str() const { return text_; }
  bool empty() const { return text_.empty(); }

 private:
  std::string text_;
};

// 'text', as messages name tags and snapshots (a tag may be any string, "" included).
inline std::string quoted(const std::string& text) { return "'" + text + "'"; }

// "0x7f12a4000000"
inline std::string hex_address(std::uintptr_t address) {
  char buffer[24];
  std::snprintf(buffer, sizeof(buffer), "0x%llx", static_cast<unsigned long long>(address));
  return buffer;
}

}  // namespace tus
