// Definitions that keep a module built with a recent GCC and glibc loadable where torch's own
// wheels load: glibc 2.28 and the C++ runtime of GCC 8 (the manylinux_2_28 platform).
//
// The headers of GCC 11 and later, and of glibc 2.29 and later, inline calls to a handful of
// runtime symbols that older systems do not have. A module that references them records a
// version requirement (GLIBC_2.32, GLIBCXX_3.4.29, CXXABI_1.3.13, ...) that the loader refuses
// on an older system, even though torch itself loads there. Each symbol below is defined in the
// module instead, with hidden visibility: the module's own references bind to it at link time,
// no version is required, and nothing outside the module sees it (a definition left visible
// would take over the C++ runtime's internal calls to the same name). Compilers of other
// versions, and other platforms, compile nothing here (docs/design.rst, decision 6).
//
// Each definition does what the runtime's own does, through interfaces that every supported
// runtime has.

#if defined(__linux__) && defined(__x86_64__)

#include <cxxabi.h>
#include <unwind.h>

#include <cstddef>
#include <exception>
#include <new>
#include <sstream>
#include <string>
#include <typeinfo>

#if defined(__GLIBCXX__) && defined(__GLIBC__)

// --- glibc ------------------------------------------------------------------------------------

#if __GLIBC_PREREQ(2, 29)
// glibc 2.29 gave pow a new symbol version (the same results, without the old error handling
// through _LIB_VERSION); the first version, GLIBC_2.2.5 on x86-64, is kept by every later glibc.
extern "C" double amp_compat_pow_first_version(double base, double exponent) noexcept;
__asm__(".symver amp_compat_pow_first_version, pow@GLIBC_2.2.5");
extern "C" double pow(double base, double exponent) noexcept {
  return amp_compat_pow_first_version(base, exponent);
}
__asm__(".hidden pow");
#endif

#if __GLIBC_PREREQ(2, 32) && defined(_GLIBCXX_RELEASE) && _GLIBCXX_RELEASE >= 11
// libstdc++ skips the atomic instructions of its reference counts (shared_ptr, locale) while
// glibc reports one thread. Reporting "not single-threaded" always keeps them atomic: the
// behaviour of glibc before 2.32, and correct in every case.
extern "C" {
char __libc_single_threaded = 0;
}
__asm__(".hidden __libc_single_threaded");
#endif

// --- libstdc++ --------------------------------------------------------------------------------

#if defined(_GLIBCXX_RELEASE) && _GLIBCXX_RELEASE >= 11
// Called by std::allocator when an array size overflows (GLIBCXX_3.4.29).
namespace std {
void __throw_bad_array_new_length() {
  throw bad_array_new_length();
}
}  // namespace std
__asm__(".hidden _ZSt28__throw_bad_array_new_lengthv");

// std::exception_ptr's copy and destruction became inline in GCC 11 and call these two members
// (CXXABI_1.3.13); earlier runtimes keep them private. They change the reference count that the
// Itanium C++ ABI's runtimes (libstdc++, libc++abi) keep in front of every thrown object.
namespace {

// The exception header of the Itanium C++ ABI, preceded by the runtimes' reference count. The
// thrown object starts right after it.
struct ItaniumException {
  std::type_info* exception_type;
  void (*exception_destructor)(void*);
  void (*unexpected_handler)();
  void (*terminate_handler)();
  ItaniumException* next_exception;
  int handler_count;
  int handler_switch_value;
  const unsigned char* action_record;
  const unsigned char* language_specific_data;
  _Unwind_Ptr catch_temp;
  void* adjusted_ptr;
  _Unwind_Exception unwind_header;
};

struct RefcountedException {
  int reference_count;
  ItaniumException exception;
};

static_assert(
    sizeof(RefcountedException) == offsetof(RefcountedException, exception) +
            sizeof(ItaniumException),
    "the thrown object must follow the exception header directly");
static_assert(sizeof(RefcountedException) == 128, "the x86-64 exception header is 128 bytes");

RefcountedException* header_of(void* thrown) {
  return static_cast<RefcountedException*>(thrown) - 1;
}

}  // namespace

namespace std {
namespace __exception_ptr {

void exception_ptr::_M_addref() noexcept {
  if (_M_exception_object != nullptr) {
    __atomic_add_fetch(&header_of(_M_exception_object)->reference_count, 1, __ATOMIC_ACQ_REL);
  }
}

void exception_ptr::_M_release() noexcept {
  if (_M_exception_object == nullptr) {
    return;
  }
  RefcountedException* header = header_of(_M_exception_object);
  if (__atomic_sub_fetch(&header->reference_count, 1, __ATOMIC_ACQ_REL) == 0) {
    if (header->exception.exception_destructor != nullptr) {
      header->exception.exception_destructor(_M_exception_object);
    }
    __cxxabiv1::__cxa_free_exception(_M_exception_object);
    _M_exception_object = nullptr;
  }
}

}  // namespace __exception_ptr
}  // namespace std
__asm__(".hidden _ZNSt15__exception_ptr13exception_ptr9_M_addrefEv");
__asm__(".hidden _ZNSt15__exception_ptr13exception_ptr10_M_releaseEv");
#endif

#if defined(_GLIBCXX_RELEASE) && _GLIBCXX_RELEASE >= 9 && _GLIBCXX_USE_CXX11_ABI
// The default constructor of std::ostringstream became a symbol of its own in GCC 9
// (GLIBCXX_3.4.26); the header's inline definition is instantiated here.
template std::__cxx11::basic_ostringstream<char>::basic_ostringstream();
__asm__(".hidden _ZNSt7__cxx1119basic_ostringstreamIcSt11char_traitsIcESaIcEEC1Ev");
#endif

#if defined(_GLIBCXX_RELEASE) && _GLIBCXX_RELEASE >= 11 && _GLIBCXX_USE_CXX11_ABI && \
    __cplusplus > 201703L
// C++20's std::stringbuf::str() const & and str() && (GLIBCXX_3.4.29).
template std::__cxx11::basic_string<char> std::__cxx11::basic_stringbuf<char>::str() const&;
template std::__cxx11::basic_string<char> std::__cxx11::basic_stringbuf<char>::str() &&;
__asm__(".hidden _ZNKRSt7__cxx1115basic_stringbufIcSt11char_traitsIcESaIcEE3strEv");
__asm__(".hidden _ZNOSt7__cxx1115basic_stringbufIcSt11char_traitsIcESaIcEE3strEv");
#endif

#endif  // __GLIBCXX__ && __GLIBC__
#endif  // __linux__ && __x86_64__
