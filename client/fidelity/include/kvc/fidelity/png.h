// A small RGB raster with lines, rectangles and a built-in 5x7 bitmap font, and a PNG encoder
// (8-bit truecolor, zlib-compressed IDAT), for the fidelity tool's plots.
#ifndef KVC_FIDELITY_PNG_H_
#define KVC_FIDELITY_PNG_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace kvc::fidelity {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb& o) const { return r == o.r && g == o.g && b == o.b; }
};

// Glyph cell of the built-in font: 5x7 pixels plus one column of spacing, times `scale`.
inline constexpr int kGlyphWidth = 5;
inline constexpr int kGlyphHeight = 7;

class Image {
 public:
  // width, height >= 1 (smaller values are raised to 1).
  Image(int width, int height, Rgb background);

  int width() const { return width_; }
  int height() const { return height_; }
  const std::vector<uint8_t>& pixels() const { return rgb_; }  // row-major RGB

  // Drawing clips to the image; coordinates outside are ignored, never an error.
  void Set(int x, int y, Rgb c);
  Rgb At(int x, int y) const;                            // black outside
  void FillRect(int x0, int y0, int x1, int y1, Rgb c);  // inclusive corners, any order
  void Line(int x0, int y0, int x1, int y1, Rgb c, int thickness = 1);
  // Text with its top-left corner at (x, y); lowercase letters are drawn as capitals, characters
  // the font lacks as '?'. Vertical text runs bottom to top, its bottom-left corner at (x, y).
  void Text(int x, int y, const std::string& text, Rgb c, int scale = 1);
  void TextVertical(int x, int y, const std::string& text, Rgb c, int scale = 1);
  static int TextWidth(const std::string& text, int scale = 1);

 private:
  int width_, height_;
  std::vector<uint8_t> rgb_;
};

// Rows of the glyph for `ch` (bit 4 = leftmost column); the '?' glyph for unknown characters.
const uint8_t* Glyph(char ch);

// PNG bytes of the image (IHDR, one IDAT, IEND; filter 0 on every row).
absl::StatusOr<std::vector<uint8_t>> EncodePng(const Image& image);
// Encodes and writes; INTERNAL naming the path when it cannot be written.
absl::Status WritePng(const Image& image, const std::string& path);

}  // namespace kvc::fidelity

#endif  // KVC_FIDELITY_PNG_H_
