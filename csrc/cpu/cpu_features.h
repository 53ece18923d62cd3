// Runtime CPU-feature detection, the instruction-set paths of the CPU kernels
// and how the one in use is chosen (isa_select.cpp).
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace tl {
namespace cpu {

/*! \brief Code paths, from most portable to most specialised. */
enum class Isa : int {
  kGeneric = 0,     //!< portable C++ (whatever the compiler's baseline target allows)
  kAvx2 = 1,        //!< AVX2 + FMA + F16C, 8-lane fp32 micro-kernels
  kAvx512 = 2,      //!< AVX-512F/BW/VL/DQ + FMA, fp32 micro-kernels
  kAvx512Bf16 = 3,  //!< kAvx512 plus AVX512_BF16 (exact bf16 dot products for the GEMM)
};

bool isa_supported(Isa isa);
/*! \brief Every path this CPU can run, most portable first. */
std::vector<Isa> supported_isas();
const char* isa_name(Isa isa);
/*!
 * \brief Reads a path name, case-insensitive, surrounding blanks ignored: sets `isa` to it,
 *        or to nullopt for "auto" (or an empty name). False if the name is unknown.
 */
bool parse_isa(const std::string& name, std::optional<Isa>* isa);

/*! \brief The path the kernels take now: forced (TL_CPU_ISA / set_cpu_isa), else measured. */
Isa current_isa();

/*! \brief How current_isa() came to be what it is. */
struct IsaChoice {
  Isa isa;
  std::string source;  //!< "forced", "measured" or "only_supported"
  std::string reason;  //!< one line for people: what forced it, or the timings that chose it
  std::vector<Isa> timed;        //!< paths timed by the measurement (empty if none ran)
  std::vector<double> seconds;   //!< best time of the probe GEMM on each of `timed`
};
IsaChoice isa_choice();

}  // namespace cpu
}  // namespace tl
